"""Load a script of scripts/ as a module for a test (the scripts are not a package, and none may be put on
sys.path: scripts/evaluate.py would shadow the `evaluate` library)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, executed as a fresh module named `name`."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
