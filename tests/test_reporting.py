"""lab.reporting's child processes: what the research scripts and the GPU smoke test launch."""

from __future__ import annotations

import os
import sys

from lab import reporting


def test_child_process_keeps_the_callers_pythonpath(tmp_path, monkeypatch):
    # The GPU smoke test found it: packages installed with `pip --target` (or a cluster's modules) reach
    # Python through PYTHONPATH; a child given only the repository lost them (DeepSpeed "not installed").
    (tmp_path / "only_on_pythonpath.py").write_text("WHERE = 'caller'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    code = (
        "import json, only_on_pythonpath, rlm, pathlib; "
        "print(json.dumps({'where': only_on_pythonpath.WHERE, 'rlm': str(pathlib.Path(rlm.__file__).parent)}))"
    )
    found = reporting.run_json([sys.executable, "-c", code], what="child")
    assert found == {"where": "caller", "rlm": str(reporting.ROOT / "rlm")}
    assert reporting.child_env()["PYTHONPATH"].split(os.pathsep) == [str(reporting.ROOT), str(tmp_path)]
    assert reporting.child_env(OMP_NUM_THREADS="1")["OMP_NUM_THREADS"] == "1"
