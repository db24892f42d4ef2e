"""Every strategy as two data-parallel processes on accelerators run it, simulated on one CPU.

NCCL all-gathers only tensors on the process's GPU; gloo takes host tensors too, so the 2-process CPU tests
(`tests/test_train_multiprocess.py`) cannot see a tensor left on the host: on the first GPU every rank would
raise at the first collective that gets one. Here the two processes are two threads of this one, each under
`device_check`'s simulated accelerator (a host tensor meeting an accelerator tensor raises as on CUDA, values
are still computed), and their collectives refuse any tensor that is not on the accelerator; otherwise they
return what two processes would (every rank's tensor, in rank order). Each registered strategy runs sharded,
with its scanned rows on the accelerator or streamed from the host, through its refreshes (step by step, the
passage tower returning host float32 as the real one does), a selection at every step and a resume from its
`state_dict`, and must select what one process alone on the host selects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from device_check import ACCELERATOR, on_accelerator, simulated_accelerator

from rlm.config import RegressionConfig, StrategyConfig
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.distributed import Processes
from rlm.retriever.index_spec import IndexSpec, TwoStage
from rlm.training.strategies import STRATEGY_CLASSES, make_strategy

WORLD = 2
N, DIM, BATCH, MAX_STEPS = 90, 8, 3, 4


class SimulatedWorld:
    """Collectives between `size` threads standing for processes whose tensors must be on ACCELERATOR."""

    def __init__(self, size: int):
        self.size = size
        self._sync = threading.Barrier(size, timeout=120)
        self._slots: list = [None] * size

    def processes(self, rank: int) -> Processes:
        return Processes(
            rank,
            self.size,
            partial(self._gather, rank),
            self._sync.wait,
            partial(self._exchange, rank),
            device=ACCELERATOR,
        )

    def abort(self) -> None:
        """A rank failed: the others stop waiting for it (as NCCL's watchdog would end them)."""
        self._sync.abort()

    def _exchange(self, rank: int, value):
        self._slots[rank] = value
        self._sync.wait()
        values = list(self._slots)
        self._sync.wait()  # every rank has read its copy before the next collective writes the slots again
        if isinstance(values[0], list):
            return [item for part in values for item in part]
        return values

    def _gather(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        assert tensor.device == ACCELERATOR, (
            f"all_gather got a tensor on {tensor.device}: NCCL takes only tensors on the process's GPU"
        )
        parts = self._exchange(rank, tensor)
        kinds = {(tuple(p.shape), p.dtype) for p in parts}
        assert len(kinds) == 1, f"all_gather of different shapes or dtypes across processes: {kinds}"
        return torch.cat(parts)


def run_processes(fn: Callable[[Processes], object], size: int = WORLD) -> list:
    """`fn(procs)` on every rank at once, each in its own thread under the simulated accelerator."""
    world = SimulatedWorld(size)
    results: list = [None] * size
    errors: list = [None] * size

    def rank_main(rank: int) -> None:
        try:
            with simulated_accelerator():  # the function mode is per thread
                results[rank] = fn(world.processes(rank))
        except BaseException as err:  # noqa: BLE001 - handed to the main thread below
            errors[rank] = err
            world.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The rank that failed first, not the ones its abort released.
    raised = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    raised = raised or [e for e in errors if e is not None]
    if raised:
        raise raised[0]
    return results


# ---- the inputs: a host buffer, a drifting passage tower, a corrector that is not the identity ----------


_g = torch.Generator().manual_seed(0)
STALE = F.normalize(torch.randn(N, DIM, generator=_g), dim=-1)
BUFFER = PassageBuffer(
    [str(i) for i in range(N)], [STALE[:20].half(), STALE[20:61].half(), STALE[61:].half()]
)
DRIFT = torch.randn(DIM, DIM, generator=_g)
QUERIES = F.normalize(torch.randn(WORLD * BATCH, DIM, generator=_g), dim=-1)
GOLD = torch.randint(0, N, (WORLD * BATCH, 1), generator=_g)
# The buffer after corpus updates removed rows (`rlm corpus update --buffer`): nearly all of the first
# process's share, so that it holds fewer live rows than k, and a few of the other's; the gold rows stay.
GROWN = PassageBuffer(BUFFER.ids, [STALE[:20].half(), STALE[20:61].half(), STALE[61:].half()])
GROWN.removed = np.setdiff1d([*range(43), 50, 70, 89], GOLD.numpy())


def tower(step: int, rows) -> torch.Tensor:
    """The passage tower after `step` updates (drifting away from B), embedding `rows` as the real tower does:
    float32 on the host, whatever device the run is on."""
    rows = torch.as_tensor(list(rows), dtype=torch.long)
    return F.normalize(STALE[rows] @ (torch.eye(DIM) + 0.05 * step * DRIFT), dim=-1)


def make_corrector() -> CorrectorNetwork:
    torch.manual_seed(0)
    corrector = CorrectorNetwork(DIM, 16, linear=True)
    with torch.no_grad():
        corrector.output.weight.normal_(std=0.3)
        corrector.linear.weight.normal_(std=0.1)
    return corrector


@dataclass(frozen=True)
class Case:
    name: str
    extra: str = ""  # "alg1": Algorithm 1's forced label and uniform rows; "index"/"scan": two-stage search
    removed: bool = False  # over `GROWN`, rows of which no selection may return

    @property
    def buffer(self) -> PassageBuffer:
        return GROWN if self.removed else BUFFER

    @property
    def cfg(self) -> StrategyConfig:
        cfg = StrategyConfig(
            name=self.name,
            k=5,
            refresh_every=1,
            snm_size=40,
            regression=RegressionConfig(samples=31, landmarks=8),
        )
        if self.extra in ("index", "scan"):
            # Every row a candidate: two-stage must then select what exact selects, sharded or not.
            stage = TwoStage(first_stage=self.extra, overlap_every=2, index=IndexSpec(factory="Flat"))
            cfg = replace(cfg, search="two_stage", two_stage=stage)
        return cfg

    def select(self, strategy, queries, gold, corrector):
        corrector = corrector if strategy.uses_corrector else None  # only a strategy that selects through h
        if self.name == "closed_book":
            with pytest.raises(RuntimeError, match="no passages"):
                strategy.select(queries, corrector)
            return None
        if self.name == "in_batch" or self.extra == "alg1":
            num_random = 0 if self.name == "in_batch" else 3
            return strategy.select(queries, corrector, include=gold, num_random=num_random)
        return strategy.select(queries, corrector)


REFRESHING = ("exhaustive", "regression", "two_round", "snm")
CASES = [
    *(Case(name) for name in STRATEGY_CLASSES),
    *(
        Case(name, "alg1")
        for name, cls in STRATEGY_CLASSES.items()
        if 1 in cls.algorithms and name != "in_batch"
    ),
    *(Case(name, stage) for name in ("corrector", "stale") for stage in ("index", "scan")),
]
CASES += [
    *(Case(name, removed=True) for name in STRATEGY_CLASSES),
    Case("corrector", "alg1", removed=True),
    *(Case("corrector", stage, removed=True) for stage in ("index", "scan")),
]


RESUME_AT = 2  # a step that refreshes (exhaustive, regression, SNM) or is the half (two-round)


def run_strategy(case: Case, procs: Processes, device, refresh_dir, queries, gold, corrector) -> dict:
    """Steps 0..MAX_STEPS-1 as training runs them (refresh if due, then select); then resumed from the state
    taken before step RESUME_AT and from the state at the end, as from checkpoints."""

    def placed():
        strategy = make_strategy(case.cfg, case.buffer, MAX_STEPS, seed=0)
        strategy.distribute(procs, True, device, refresh_dir=refresh_dir)
        return strategy

    def run(strategy, steps):
        picks = []
        for step in steps:
            strategy.before_step(step, partial(tower, step))
            picks.append(case.select(strategy, queries, gold, corrector))
        return picks

    strategy = placed()
    picks = run(strategy, range(RESUME_AT))
    checkpoint = strategy.state_dict()
    picks += run(strategy, range(RESUME_AT, MAX_STEPS))
    resumed = placed()
    resumed.load_state_dict(checkpoint)
    again = run(resumed, range(RESUME_AT, MAX_STEPS))
    resumed.load_state_dict(strategy.state_dict())
    picks.append(case.select(resumed, queries, gold, corrector))
    went_on = case.select(strategy, queries, gold, corrector)  # what the uninterrupted run selects next
    return {
        "picks": picks,
        "again": again,
        "went_on": went_on,
        "reembedded": [strategy.reembedded, resumed.reembedded],
    }


def _runs():
    for case in CASES:
        # Refreshed rows are kept in memory or written to files; the others never write any.
        for placement in ("device", "host"):
            for on_disk in (False, True) if case.name in REFRESHING else (False,):
                name = "-".join(
                    [
                        case.name,
                        *([case.extra] if case.extra else []),
                        *(["removed"] if case.removed else []),
                        placement,
                    ]
                )
                yield pytest.param(case, placement, on_disk, id=name + ("-files" if on_disk else ""))


@pytest.mark.parametrize("case, placement, on_disk", list(_runs()))
def test_every_strategy_runs_sharded_on_accelerators_as_one_process_on_the_host(
    case, placement, on_disk, tmp_path
):
    corrector = make_corrector()
    ranks = [slice(r * BATCH, (r + 1) * BATCH) for r in range(WORLD)]
    # What each rank's questions get from one process alone, everything on the host.
    expected = [
        run_strategy(
            case,
            Processes(),
            None,
            tmp_path / f"whole{r}" if on_disk else None,
            QUERIES[mine],
            GOLD[mine],
            corrector,
        )
        for r, mine in enumerate(ranks)
    ]

    def rank_main(procs: Processes) -> dict:
        mine = ranks[procs.rank]
        return run_strategy(
            case,
            procs,
            ACCELERATOR if placement == "device" else None,
            tmp_path / "sharded" if on_disk else None,
            QUERIES[mine].to(ACCELERATOR),
            GOLD[mine].to(ACCELERATOR),  # as the step moves the batch's gold rows
            corrector,
        )

    with simulated_accelerator(corrector):
        got = run_processes(rank_main)

    for rank, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g["reembedded"] == e["reembedded"] and len(set(g["reembedded"])) == 1
        if g["went_on"] is not None:
            assert torch.equal(g["picks"][-1].indices, g["went_on"].indices), f"rank {rank}: resumed"
            for step, (again, first) in enumerate(zip(g["again"], g["picks"][RESUME_AT:MAX_STEPS])):
                assert torch.equal(again.indices, first.indices), (
                    f"rank {rank}: step {RESUME_AT + step} again"
                )
        for step, (top, ref) in enumerate(zip(g["picks"], e["picks"], strict=True)):
            if ref is None:  # closed book
                assert top is None
                continue
            where = f"rank {rank}, " + (f"step {step}" if step < MAX_STEPS else "resumed")
            assert on_accelerator(top.indices) and on_accelerator(top.scores), where
            assert top.scores.dtype == torch.float32, where
            assert torch.equal(top.indices.cpu(), ref.indices), where
            assert not np.isin(top.indices.cpu().numpy(), case.buffer.removed).any(), where
            torch.testing.assert_close(top.scores.cpu(), ref.scores, rtol=1e-4, atol=1e-5, msg=where)


def test_every_registered_strategy_is_a_case():
    assert {c.name for c in CASES} == set(STRATEGY_CLASSES)
    # A new strategy that re-embeds must be run with its refreshes on disk too.
    assert set(REFRESHING) == {
        name for name, cls in STRATEGY_CLASSES.items() if not cls.scans_fixed_buffer and cls.uses_passages
    } - {"in_batch"}


# ---- the checker itself ------------------------------------------------------------------------------


def test_simulated_collectives_refuse_host_tensors_and_return_what_two_processes_would():
    def gather_own_rank(procs: Processes):
        mine = torch.full((2, 3), float(procs.rank), device=ACCELERATOR)
        return procs.gather(mine), procs.gather_object([procs.rank, "x"])

    for tensor, objects in run_processes(gather_own_rank):
        assert on_accelerator(tensor)
        assert torch.equal(tensor.cpu(), torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
        assert objects == [0, "x", 1, "x"]

    def gather_host(procs: Processes):
        procs.gather(torch.zeros(2, 3))

    with pytest.raises(AssertionError, match="NCCL takes only"):
        run_processes(gather_host)

    def gather_on_one_rank_only(procs: Processes):
        procs.gather(torch.zeros(2, 3, device=ACCELERATOR if procs.rank == 0 else "cpu"))

    with pytest.raises(AssertionError, match="NCCL takes only"):  # the other rank is released, not hung
        run_processes(gather_on_one_rank_only)
