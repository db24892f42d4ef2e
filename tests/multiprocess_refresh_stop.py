"""Run by tests/test_run_lifecycle.py under `accelerate launch`: `rlm train` in which only rank 1 gets SIGTERM,
while it embeds the first part of the refresh before step 2 (a scheduler's signal reaches the processes of a job
at different moments; rank 0 hears nothing itself).

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/multiprocess_refresh_stop.py --set ...
"""

from __future__ import annotations

import os
import signal
import sys

import rlm.training.run as run_module
from rlm.cli import main

SIGNAL_BEFORE_STEP = 2
reembed, embed_rows, at = run_module.TrainRun.reembed, run_module.embed_rows, {}


def reembed_noting_the_step(self, rows):
    at["step"] = self.state.step
    return reembed(self, rows)


def embed_and_signal(tower, texts, rows, batch_size=64):
    if os.environ.get("RANK") == "1" and at.get("step") == SIGNAL_BEFORE_STEP and not at.get("sent"):
        at["sent"] = True
        os.kill(os.getpid(), signal.SIGTERM)
    return embed_rows(tower, texts, rows, batch_size)


if __name__ == "__main__":
    run_module.REEMBED_PART_ROWS = 32  # a refresh of the 120-passage world in several parts
    run_module.TrainRun.reembed = reembed_noting_the_step
    run_module.embed_rows = embed_and_signal
    sys.exit(main(["train", *sys.argv[1:]]))
