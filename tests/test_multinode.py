"""Several machines (issue 29): two "machines" on localhost, one process each, each started by its own
`accelerate launch --num_machines 2 --machine_rank R --main_process_ip 127.0.0.1`, train what one machine
with two processes trains: the same learning rates and losses, step for step. The shipped multi-node accelerate
config and Slurm script are checked for what can be checked without a cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from local_port import CPU_2PROC, accelerate_launch, free_port, launch_env
from tiny_run import read_log, same_losses, train_args

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_machines_of_one_process_train_what_one_machine_of_two_trains(two_process_run):
    """One machine of two processes: the session's run (tests/conftest.py), `rlm.train` with these arguments."""
    program = ["-m", "rlm.train"]
    root = two_process_run
    port = free_port()  # the two machines meet on one port
    machines = [
        subprocess.Popen(
            [
                *accelerate_launch(
                    CPU_2PROC,
                    *("--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2"),
                    *("--main_process_ip", "127.0.0.1"),
                    port=port,
                ),
                *program,
                *train_args(root, "two_machines", "save_every=0"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=launch_env(),
        )
        for rank in (0, 1)
    ]
    for machine in machines:
        _, stderr = machine.communicate(timeout=600)
        assert machine.returncode == 0, stderr[-3000:]
    single, split = read_log(root / "reference" / "log.jsonl"), read_log(root / "two_machines" / "log.jsonl")
    same_losses(split, single)
    for step, record in single.items():
        assert {k: v for k, v in split[step].items() if k.startswith("lr_")} == {
            k: v for k, v in record.items() if k.startswith("lr_")
        }
    summary = json.loads((root / "two_machines" / "summary.json").read_text())
    assert summary["steps"] == 6 and sorted(single) == list(range(1, 7))


def test_the_shipped_multinode_config_and_slurm_script_agree():
    config = yaml.safe_load((REPO / "configs" / "accelerate" / "multinode.yaml").read_text())
    assert config["num_machines"] > 1 and config["rdzv_backend"] == "static"
    assert config["num_processes"] % config["num_machines"] == 0
    script = REPO / "configs" / "slurm" / "train_multinode.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "configs/accelerate/multinode.yaml" in text and '--machine_rank "$SLURM_NODEID"' in text
    assert "--signal=TERM@" in text and "-m rlm.train --resume" in text and "scontrol requeue" in text
