"""How much of the passage tower's drift each stale-buffer fix leaves, measured against every passage.

    python scripts/refresh_error.py --run runs/compare/alg1_toy_random_gtr/corrector_seed0 \
        --buffer runs/compare/alg1_toy_random_gtr/buffer --corpus runs/compare/alg1_toy_random_gtr/toy/corpus.jsonl

Re-embeds the whole corpus with the run's trained passage tower (g), then reports the share of the drift
|g(y) - B_y|^2 left by: the run's corrector h(B) (when it has one), and Dynnibal's Nystrom regression fitted
on s' random passages (for each `--samples`, ridge chosen on held-out samples as training does), scored on
the passages it was not fitted on. 0: the fresh embeddings exactly; 1: no better than the stale buffer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rlm.experiments.reporting import arguments, table


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--run", type=Path, required=True, help="a training run folder (with final/)")
    parser.add_argument("--buffer", type=Path, required=True, help="the run's fixed buffer B")
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--samples", default="200,500,1000", help="s' values for the regression")
    parser.add_argument("--landmarks", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=128, help="passage tokens (the run's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from retriever.buffer import PassageBuffer
    from retriever.corrector import CorrectorNetwork
    from retriever.encoder import DualEncoder
    from retriever.reencode import NystromRegression, residual
    from rlm.data.corpus import load_corpus

    final = args.run / "final"
    buffer = PassageBuffer.load(args.buffer)
    stale = buffer.rows(torch.arange(len(buffer))).float()
    tower = DualEncoder.from_pretrained(str(final / "retriever")).passage_tower.eval()
    tower.max_length = args.max_length
    with torch.inference_mode():
        fresh = tower.encode(load_corpus(args.corpus).retrieval_texts()).float()
        print(f"{len(stale)} passages; mean |g(y) - B_y| = {float((fresh - stale).norm(dim=-1).mean()):.3f}")
        rows = []
        if (final / "corrector").is_dir():
            corrector = CorrectorNetwork.from_pretrained(final / "corrector").eval()
            rows.append(
                {"fix": "corrector h(B)", "count": 0, "left": residual(corrector(stale), stale, fresh)}
            )
        generator = torch.Generator().manual_seed(args.seed)
        landmarks = stale[torch.randperm(len(stale), generator=generator)[: args.landmarks]]
        for count in (int(x) for x in args.samples.split(",")):
            order = torch.randperm(len(stale), generator=generator)
            fitted, unseen = order[:count], order[count:]
            model, scores = NystromRegression.fit_validated(stale[fitted], fresh[fitted], landmarks)
            left = residual(model(stale[unseen]), stale[unseen], fresh[unseen])
            ridge = min(scores, key=scores.get)
            rows.append({"fix": f"Nystrom regression (ridge {ridge:g})", "count": count, "left": left})
    columns = [
        ("fix", "fix", ""),
        ("re-embedded", "count", "d"),
        ("drift left (passages it did not see)", "left", ".3f"),
    ]
    print(table(rows, columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
