"""Run by tests/test_train_multiprocess.py under one `accelerate launch`: the selection probe
(tests/multiprocess_select.py), then the training probe (tests/multiprocess_train.py), in the same two processes,
each with its own arguments and run: a launch of two processes is ~20 CPU-s of start-up before either starts.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/multiprocess_probes.py \
        SELECT_OUT --set ... -- TRAIN_OUT [--nan-rank R --nan-call C] --set ...
"""

from __future__ import annotations

import sys

import multiprocess_select
import multiprocess_train

if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--")
    multiprocess_select.main(argv[:split], end_training=False)
    multiprocess_train.main(argv[split + 1 :])
