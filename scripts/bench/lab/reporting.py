"""What every research script writes: markdown tables, the run's JSON, its plots, each file written whole or not
at all (`atomicio`), under `scripts/bench/reports/<study>/` by default.

A script keeps its measurements in one JSON and makes its markdown and plots from that JSON alone, so
`--render` redoes them without measuring again. A hand-written section of a report between `FINDINGS_START`
and `FINDINGS_END` survives every rewrite of it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlm.base.atomicio import atomic_file, atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "scripts" / "bench" / "reports"
FINDINGS_START, FINDINGS_END = "<!-- findings:start -->", "<!-- findings:end -->"
_FINDINGS = re.compile(re.escape(FINDINGS_START) + ".*?" + re.escape(FINDINGS_END), re.S)

# A column: (title, the row's key or a function of the row, format spec).
Column = tuple[str, str | Callable[[dict], Any], str]


def results_path(study: str, name: str | None = None) -> Path:
    """The default output stem of a study: scripts/bench/reports/<study>/<name or study>."""
    return RESULTS / study / (name or study)


def cell(value: Any, spec: str = "") -> str:
    """One table cell: '-' for a missing value, text as it is (the spec formats numbers), '|' escaped so that
    text cannot split the row."""
    if value is None:
        return "-"
    return (value if isinstance(value, str) else format(value, spec)).replace("|", "\\|")


def table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A markdown table, one line per row; columns with a format spec (numbers) are right-aligned."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |"]
    lines.append("|" + "".join(" ---: |" if spec else " --- |" for _, _, spec in columns))
    for row in rows:
        values = [key(row) if callable(key) else row.get(key) for _, key, _ in columns]
        lines.append("| " + " | ".join(cell(v, spec) for v, (_, _, spec) in zip(values, columns)) + " |")
    return "\n".join(lines)


def arguments(doc: str) -> argparse.ArgumentParser:
    """A script's parser: its module docstring, as written, is the help text."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def int_list(text: str) -> list[int]:
    """'1000,2000' -> [1000, 2000]: an option that takes several sizes."""
    return [int(x) for x in text.split(",") if x]


def command(script: str, argv: Sequence[str] | None = None) -> str:
    """How this run was started: `python scripts/bench/<script> ARGS` (the process's own arguments by default)."""
    return shlex.join(["python", f"scripts/bench/{script}", *(sys.argv[1:] if argv is None else argv)])


def cpu_name() -> str:
    """The CPU model as `lscpu` names it (timings on this machine are only comparable on one CPU model)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1/5/15-minute load average: other jobs on the shared cores show here."""
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def machine() -> dict:
    """Where and when a measurement was taken: timings are comparable only on one CPU model, at one load."""
    import torch

    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average": load_average(),
    }


def machine_line(m: dict) -> str:
    return (
        f"{m['date']}; {m['cpu']}, {m['cores']} cores, {m['threads']} torch thread(s), torch {m['torch']}; "
        f"load average {m['load_average']}"
    )


def figure(ncols: int = 1, size: tuple[float, float] = (6, 4), **kwargs):
    """(figure, axes) drawn off-screen (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size, **kwargs)


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")  # the temporary name has no .png suffix
    plt.close(fig)


def keep_findings(text: str, path: Path) -> str:
    """`text` with the hand-written findings of the report at `path` in place of its own findings block, or
    appended when it has none."""
    old = _FINDINGS.search(path.read_text()) if path.is_file() else None
    if old is None:
        return text
    if _FINDINGS.search(text):
        return _FINDINGS.sub(lambda _: old.group(0), text, count=1)
    return f"{text.rstrip()}\n\n{old.group(0)}\n"


def write_report(
    stem: str | os.PathLike,
    markdown: str,
    results: dict | None = None,
    plots: dict[str, Callable[[], Any]] | None = None,
    echo: bool = True,
) -> None:
    """`<stem>.json` (unless `results` is None: a re-render), `<stem>.md` (findings kept) and each plot of
    `plots` ({file suffix: a function returning the figure, or None to leave that file as it is}, e.g.
    {".png": ...}); prints the markdown."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    if results is not None:
        atomic_write_json(stem.with_suffix(".json"), json.loads(json.dumps(results, default=str)))
    md = stem.with_suffix(".md")
    text = keep_findings(markdown.rstrip() + "\n", md)
    atomic_write_text(md, text)
    for suffix, draw in (plots or {}).items():
        if (fig := draw()) is not None:
            save_figure(fig, stem.with_name(stem.name + suffix))
    if echo:
        print(text)


def load_results(path: str | os.PathLike) -> dict:
    """A saved run's JSON for `--render`; a missing file is the user's mistake, said in one line."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: {path}: no such file (a JSON this script wrote)")
    return json.loads(path.read_text())


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a child process that imports the checkout: the repository first on PYTHONPATH,
    the caller's entries kept after it (packages a cluster's modules or a `pip --target` put there)."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), **extra}


def run_json(cmd: Sequence[str], env: dict | None = None, what: str = "measurement") -> dict:
    """Run a child process (its own memory figures, threads and process group) and return the JSON object
    it printed last; its output tails in the error when it fails."""
    env = child_env(**(env or {}))
    done = subprocess.run(list(cmd), capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])
