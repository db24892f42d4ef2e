"""Free TCP ports on 127.0.0.1: for tests that serve the demo, and for every launch of several processes.

Launches get a port of their own because `make test` runs two pytest-xdist workers: two `accelerate launch`
runs at once would both take accelerate's default 29500 (torchrun's too) and one would fail with the port
in use. tests/test_layering.py holds the tests to building their launches here."""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_2PROC = REPO / "configs" / "accelerate" / "cpu_2proc.yaml"
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; elsewhere its default, 32768


def free_port() -> int:
    """A port nothing listens on now, drawn below the kernel's ephemeral range: a port the OS hands out itself
    can be handed out again, before the launcher binds it, to any outgoing connection (gloo opens many), and a
    launch then fails with the port in use."""
    low = int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.is_file() else 32768
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(20000, max(20001, min(low, 32768)))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port found below the ephemeral range")


def accelerate_launch(config: str | Path, *args: str, port: int | None = None) -> list[str]:
    """`accelerate launch --config_file CONFIG ARGS`, as the README launches it, on a free port (`port`: the
    one that machines of one run share)."""
    port = port or free_port()
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    return [*launch, "--main_process_port", str(port), *args]


def torchrun(processes: int, *args: str) -> list[str]:
    """`torchrun --nproc_per_node PROCESSES ARGS` on a free port."""
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return [*run, "--master_port", str(free_port()), *args]


def two_processes(*program: str) -> list[str]:
    """`accelerate launch` of PROGRAM on two CPU processes of one machine (cpu_2proc.yaml), as the README
    launches it."""
    return accelerate_launch(CPU_2PROC, *program)


def launch_env() -> dict:
    """The environment a launch runs in: offline, one torch thread per process, this checkout importable."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
