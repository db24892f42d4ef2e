"""Several machines (issue 29): two "machines" on localhost, one process each, each started by its own
`accelerate launch --num_machines 2 --machine_rank R --main_process_ip 127.0.0.1`, train what one machine
with two processes trains: the same learning rates and losses, step for step. The shipped multi-node accelerate
config and Slurm script are checked for what can be checked without a cluster."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_run_lifecycle import args, env, read_log, same_losses

REPO = Path(__file__).resolve().parents[1]
CPU_2PROC = REPO / "configs" / "accelerate" / "cpu_2proc.yaml"


def launcher(*flags: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_2PROC), *flags]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_machines_of_one_process_train_what_one_machine_of_two_trains(tmp_path):
    program = ["-m", "rlm.train"]
    one = subprocess.run(
        [*launcher(), *program, *args(tmp_path, "one_machine", "save_every=0", steps=4)],
        capture_output=True,
        text=True,
        env=env(),
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    port = str(free_port())
    machines = [
        subprocess.Popen(
            [
                *launcher("--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2"),
                *("--main_process_ip", "127.0.0.1", "--main_process_port", port),
                *program,
                *args(tmp_path, "two_machines", "save_every=0", steps=4),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        for rank in (0, 1)
    ]
    for machine in machines:
        _, stderr = machine.communicate(timeout=600)
        assert machine.returncode == 0, stderr[-3000:]
    single, split = (
        read_log(tmp_path / "one_machine" / "log.jsonl"),
        read_log(tmp_path / "two_machines" / "log.jsonl"),
    )
    same_losses(split, single)
    for step, record in single.items():
        assert {k: v for k, v in split[step].items() if k.startswith("lr_")} == {
            k: v for k, v in record.items() if k.startswith("lr_")
        }
    summary = json.loads((tmp_path / "two_machines" / "summary.json").read_text())
    assert summary["steps"] == 4


def test_the_shipped_multinode_config_and_slurm_script_agree():
    config = yaml.safe_load((REPO / "configs" / "accelerate" / "multinode.yaml").read_text())
    assert config["num_machines"] > 1 and config["rdzv_backend"] == "static"
    assert config["num_processes"] % config["num_machines"] == 0
    script = REPO / "configs" / "slurm" / "train_multinode.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "configs/accelerate/multinode.yaml" in text and '--machine_rank "$SLURM_NODEID"' in text
    assert "--signal=TERM@" in text and "-m rlm.train --resume" in text and "scontrol requeue" in text
