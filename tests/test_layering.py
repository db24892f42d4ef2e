"""The dependency arrows of docs/architecture.md: app -> rlm -> reader, retriever -> atomicio, evalmode (the CLI's
`rlm demo` and `rlm calibrate` commands, rlm/commands/demo.py and calibrate.py, are the places in `rlm` that use
the app: the one serves it, the other calibrates the answers it serves)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"app", "rlm", "reader", "retriever", "atomicio", "evalmode"}
MAY_IMPORT = {
    "atomicio": set(),
    "evalmode": set(),
    "reader": {"atomicio", "evalmode"},
    "retriever": {"atomicio", "evalmode"},
    "rlm": {"reader", "retriever", "atomicio", "evalmode"},
    "app": {"rlm", "reader", "retriever", "atomicio", "evalmode"},
}


CLI_USES_APP = {ROOT / "rlm" / "commands" / "demo.py", ROOT / "rlm" / "commands" / "calibrate.py"}


def imported_packages(package: str) -> dict[str, str]:
    """Our top-level packages imported anywhere in `package` (functions' lazy imports included) -> a file."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if path in CLI_USES_APP:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in OURS and top != package:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_each_package_imports_only_what_the_architecture_allows(package):
    found = imported_packages(package)
    assert set(found) <= MAY_IMPORT[package], {k: v for k, v in found.items() if k not in MAY_IMPORT[package]}
