"""Run by tests/test_evaluation.py under `accelerate launch`: `rlm` commands as a user runs them, one after the
other in the same two processes (a launch costs ~20 CPU-s of start-up), with the main process's index build
slowed by SLOW_S seconds (past the process group's timeout the test sets), and each process reporting to
`REPORT_DIR/rank<R>.json` what it did: the timeout its process group was made with, how many times it tuned an
index, the faiss IO flag of each index it loaded, and how many passages it checked for an answer (DPR's
`has_answer`, what recall@k costs).

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/multiprocess_evaluate.py \
        REPORT_DIR SLOW_S evaluate --checkpoint ... --dist-timeout 20 [-- evaluate --index ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    report_dir, slow_s, commands = Path(argv[0]), float(argv[1]), [[]]
    for arg in argv[2:]:
        if arg == "--":
            commands.append([])
        else:
            commands[-1].append(arg)
    rank = int(os.environ["RANK"])
    report = {"rank": rank, "timeout_s": None, "tunes": 0, "loads": [], "has_answer_calls": 0}

    import torch.distributed

    from rlm.cli import main as rlm_main
    from rlm.inference import metrics
    from rlm.retriever.index import PassageIndex

    init_process_group = torch.distributed.init_process_group

    def recorded_init(*args, **kwargs):
        timeout = kwargs.get("timeout")
        report["timeout_s"] = None if timeout is None else timeout.total_seconds()
        return init_process_group(*args, **kwargs)

    from_buffer, tune, load = PassageIndex.from_buffer.__func__, PassageIndex.tune, PassageIndex.load.__func__

    def slow_from_buffer(cls, *args, **kwargs):
        time.sleep(slow_s)  # a 21M-passage build, in miniature: longer than the process group's timeout
        return from_buffer(cls, *args, **kwargs)

    def counted_tune(self, *args, **kwargs):
        report["tunes"] += 1
        return tune(self, *args, **kwargs)

    def recorded_load(cls, *args, **kwargs):
        index = load(cls, *args, **kwargs)
        report["loads"].append({"mapped": getattr(index, "mapped", None), "factory": index.factory})
        return index

    has_answer = metrics.has_answer

    def counted_has_answer(*args, **kwargs):
        report["has_answer_calls"] += 1
        return has_answer(*args, **kwargs)

    torch.distributed.init_process_group = recorded_init
    PassageIndex.from_buffer = classmethod(slow_from_buffer)
    PassageIndex.tune = counted_tune
    PassageIndex.load = classmethod(recorded_load)
    metrics.has_answer = counted_has_answer
    try:
        for command in commands:
            code = rlm_main(command)
            if code:
                return code
        return 0
    finally:
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
