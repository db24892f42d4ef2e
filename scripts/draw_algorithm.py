"""Draw Algorithm 2 (one training step) as a box-and-arrow figure for the README: docs/algorithm2.png.

    python scripts/draw_algorithm.py [--out docs/algorithm2.png]

Solid arrows carry gradients, dashed ones do not (stop-gradient); colours: blue = retriever (query tower f,
passage tower g), orange = reader, green = corrector h over the fixed buffer B.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from rlm.base.atomicio import atomic_file

ROOT = Path(__file__).resolve().parents[1]
BLUE, ORANGE, GREEN, GREY = "#dbe9f6", "#fde3c8", "#d9f0d3", "#eeeeee"

# name: (x, y, width, height, colour, label); coordinates in a 16 x 9 canvas
BOXES = {
    "x": (0.3, 6.6, 2.2, 1.0, GREY, "question x\n(answer a)"),
    "f": (3.3, 6.6, 2.4, 1.0, BLUE, "1. q = f(x)\nquery tower"),
    "B": (0.3, 3.6, 2.2, 1.4, GREY, "buffer B\n(stale, built once,\nnever re-embedded)"),
    "h": (3.3, 3.6, 2.4, 1.4, GREEN, "corrector h(B)\nstreamed in chunks"),
    "topk": (6.6, 5.0, 2.9, 1.4, GREY, "2. S_x = top-k\n<q, h(B_y)>\nover all of B"),
    "g": (10.3, 6.6, 2.6, 1.0, BLUE, "3. p_y = g(y), y in S_x\npassage tower"),
    "ptilde": (13.5, 6.6, 2.3, 1.0, BLUE, "P~(y|x) = softmax\n(beta <q, p_y>), q of 1."),
    "reader1": (10.3, 4.4, 2.6, 1.1, ORANGE, "4. reader alone per y:\nP(a|y,x) -> P_a(y|x)"),
    "L": (13.5, 4.4, 2.3, 1.1, BLUE, "5. L = KL(P_a || P~)\nretriever loss"),
    "fid": (10.3, 2.3, 2.6, 1.1, ORANGE, "6. FiD over all k:\nL' = -log P(a|S_x,x)"),
    "ph": (6.6, 1.6, 2.9, 1.4, GREEN, "7. P~_h = softmax(\nbeta <q, h(B_y)>)\nl = CE(P~, P~_h)"),
    "update": (13.5, 1.2, 2.3, 2.2, GREY, "8. update f, g, reader\non (L + L') / 2;\nh on l only"),
}

# "from>to" carries a gradient, "from~to" does not; drawn in this order.
EDGES = (
    "x>f f~topk B~h h~topk topk~g g>ptilde topk~reader1 reader1~L ptilde>L topk~fid h>ph ptilde~ph L>update"
)
ARROWS = [
    (a, b, sep == ">") for a, sep, b in re.findall(r"(\w+)([>~])(\w+)", EDGES + " fid>update ph>update")
]


def _anchor(name: str, toward: str) -> tuple[float, float]:
    """The point on box `name`'s border that faces the centre of box `toward`."""
    x, y, w, h = BOXES[name][:4]
    tx, ty, tw, th = BOXES[toward][:4]
    cx, cy, ox, oy = x + w / 2, y + h / 2, tx + tw / 2, ty + th / 2
    dx, dy = ox - cx, oy - cy
    scale = min(w / 2 / abs(dx) if dx else float("inf"), h / 2 / abs(dy) if dy else float("inf"))
    return cx + dx * scale, cy + dy * scale


def draw(out: Path) -> None:
    """Render the figure and write it to `out` atomically."""
    fig, ax = plt.subplots(figsize=(16, 9), dpi=100)
    ax.set(xlim=(0, 16), ylim=(0, 9))
    ax.axis("off")
    title = "Algorithm 2: one training step (Monath et al., ICML 2024)"
    ax.text(8, 8.55, title, ha="center", fontsize=17, weight="bold")
    for x, y, w, h, colour, label in BOXES.values():
        ax.add_patch(
            FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", facecolor=colour, edgecolor="#555555")
        )
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=10.5)
    for start, end, grad in ARROWS:
        look = {"linestyle": "-", "color": "#333333"} if grad else {"linestyle": "--", "color": "#888888"}
        ends = _anchor(start, end), _anchor(end, start)
        ax.add_patch(FancyArrowPatch(*ends, arrowstyle="-|>", mutation_scale=14, linewidth=1.4, **look))
    legend = (
        "solid arrow: gradient flows    dashed arrow: no gradient (torch.no_grad / detach)    "
        "blue: retriever    orange: reader    green: corrector"
    )
    ax.text(0.3, 0.35, legend, fontsize=10.5, color="#333333")
    with atomic_file(out) as tmp:
        fig.savefig(tmp, bbox_inches="tight", format="png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "algorithm2.png"))
    args = parser.parse_args()
    draw(Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
