"""Library functions stay short enough to read in one screen (issue 49): at most 60 lines each, from `def` to
the last line, signature and docstring included. The training steps of `rlm/training/steps.py` are the
exception: `algorithm2_step` is the paper's eight steps in order, and reads better whole."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlm", "reader", "retriever", "app")  # rlm/ links to the other three: each file counted once
LIMIT = 60
STEPS = ROOT / "rlm" / "training" / "steps.py"


def long_functions(root: Path = ROOT, limit: int = LIMIT) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                lines = node.end_lineno - node.lineno + 1
                if path == root / STEPS.relative_to(ROOT) and node.name.endswith("_step"):
                    continue
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_every_library_function_is_at_most_60_lines_the_training_steps_aside():
    assert long_functions() == []


def test_the_count_sees_a_long_function_and_spares_a_step(tmp_path):
    (tmp_path / "rlm" / "training").mkdir(parents=True)
    for package in PACKAGES[1:]:
        (tmp_path / package).mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT))
    (tmp_path / "reader" / "long.py").write_text(f"def too_long():\n{body}")
    (tmp_path / "rlm" / "training" / "steps.py").write_text(f"def algorithm2_step():\n{body}")
    assert long_functions(tmp_path) == [f"reader/long.py:1 too_long ({LIMIT + 1} lines)"]
