"""Load a script of scripts/ or scripts/bench/ as a module for a test (the scripts are not a package; only
scripts/bench, for its `lab`, goes on sys.path, in tests/conftest.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/bench/<name>.py or scripts/<name>.py, executed as a fresh module named `name`."""
    path = SCRIPTS / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path if path.exists() else SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
