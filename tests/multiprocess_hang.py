"""Run by tests/test_run_lifecycle.py under `accelerate launch`: rank 1 hangs (a stuck process) while rank 0
waits for it at a collective, with the run's `dist_timeout_s` and the run's heartbeat; rank 0 writes how long it
waited there to `<output_dir>/rank0_waited_s.txt` when the collective gives up.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/multiprocess_hang.py --set ...
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rlm.config import add_override_argument, load_config
from rlm.training.accelerator import CollectiveTimeout, make_accelerator
from rlm.training.run import heartbeat_for


def main() -> None:
    parser = argparse.ArgumentParser()
    add_override_argument(parser)
    cfg = load_config(None, parser.parse_args().overrides)
    accelerator = make_accelerator(cfg)
    timeout = CollectiveTimeout(cfg.dist_timeout_s, accelerator.num_processes > 1)
    heartbeat_for(cfg, accelerator, timeout).start()
    if accelerator.process_index == 1:
        time.sleep(3600)
    start = time.monotonic()
    try:
        accelerator.wait_for_everyone()
    finally:
        Path(cfg.output_dir, "rank0_waited_s.txt").write_text(f"{time.monotonic() - start:.3f}")


if __name__ == "__main__":
    main()
