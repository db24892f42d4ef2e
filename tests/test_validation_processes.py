"""Validation across data-parallel processes, simulated by threads of this process: each process brings only
its share of the dev questions to the sharded search, and every process gets the figures of one process.

The real launch (`accelerate launch`, tests/multiprocess_select.py) takes minutes on two cores; the
collectives of `Processes` are all validation uses, so ranks that exchange tensors in memory stand in for it.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from rlm.config import BufferConfig, ReaderConfig, StrategyConfig, TrainConfig
from rlm.retriever import distributed
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.distributed import Processes, merge_topk
from rlm.training.strategies import base as strategies_base
from rlm.training.strategies import make_strategy
from rlm.training.validation import validate


class ThreadedWorld:
    """`world` ranks as threads taking turns: a rank runs only while it holds the baton and hands it on while
    it waits in a collective, so what the ranks share (the towers' tokenizer, torch's thread pool) is never
    used by two at once, and a run is as deterministic as one process."""

    def __init__(self, world: int):
        self.world = world
        self.baton = threading.Lock()
        self.barrier = threading.Barrier(world, timeout=120)
        self.slots: list = [None] * world

    def processes(self, rank: int) -> Processes:
        return Processes(
            rank,
            self.world,
            lambda tensor: torch.cat(self._exchange(rank, tensor)),
            lambda: self._exchange(rank, None),
            lambda items: [item for part in self._exchange(rank, list(items)) for item in part],
        )

    def _exchange(self, rank: int, value) -> list:
        self.slots[rank] = value
        self._wait()  # every rank has written its part
        parts = list(self.slots)
        self._wait()  # every rank has read them before the next exchange overwrites a slot
        return parts

    def _wait(self) -> None:
        self.baton.release()
        try:
            self.barrier.wait()
        finally:
            self.baton.acquire()

    def run(self, work) -> list:
        """`work(procs)` on every rank; the results in rank order."""
        results, errors = [None] * self.world, []

        def rank_main(rank: int) -> None:
            with self.baton:
                try:
                    results[rank] = work(self.processes(rank))
                except BaseException as err:  # the other ranks must not wait for this one forever
                    errors.append(err)
                    self.barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        if errors:
            raise errors[0]
        return results


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The tiny retriever and reader over a 100-passage toy world with 7 dev questions (an uneven split)."""
    from tiny_run import tiny_retriever

    from rlm.data.corpus import load_corpus
    from rlm.data.qa import load_qa_dataset
    from rlm.data.toy_world import build_toy_world
    from rlm.reader.fid import FiDConfig, FiDReader
    from rlm.reader.small_t5 import SmallT5Config
    from rlm.reader.tokenizer import train_tokenizer
    from rlm.retriever.encoder import DualEncoder

    root = tmp_path_factory.mktemp("validation_processes")
    paths = build_toy_world(root / "world", num_passages=100, max_questions={"dev": 7})
    corpus, dev = load_corpus(paths.corpus), load_qa_dataset("toy", "dev", paths.root)
    assert len(dev) == 7
    retriever = DualEncoder.from_pretrained(str(tiny_retriever(root / "tiny")), max_length=32).eval()
    tokenizer = train_tokenizer(list(corpus.retrieval_texts()), vocab_size=300, min_frequency=1)
    reader = FiDReader.from_config(
        tokenizer,
        SmallT5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2),
        fid_config=FiDConfig(max_passage_length=32, max_answer_length=4),
        seed=0,
    ).eval()
    buffer = PassageBuffer.from_embeddings(
        corpus.ids, retriever.passage_tower.encode(corpus.retrieval_texts()).half()
    )
    torch.manual_seed(0)
    corrector = CorrectorNetwork(buffer.dim, 32, linear=True)
    with torch.no_grad():  # not the identity: h(B) ranks otherwise than B
        corrector.output.weight.normal_(std=0.05)
    model = SimpleNamespace(retriever=retriever, reader=reader, corrector=corrector)
    cfg = TrainConfig(
        strategy=StrategyConfig(name="corrector", k=3),
        buffer=BufferConfig(batch_size=16),
        reader=ReaderConfig(num_passages=2),
    )
    return model, corpus, dev, buffer, cfg


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("selection", [False, True], ids=["corpus", "selection"])
def test_each_process_searches_only_its_share_of_the_dev_questions(parts, monkeypatch, world, selection):
    """7 questions over 2 processes are 4 + 3 (padded to 4), over 3 processes 3 + 3 + 1 (padded to 3): the
    queries each process hands the sharded top-k, where all of them used to be handed by every process and
    gathered W times over. Every process still reports exactly the figures of one process."""
    model, corpus, dev, buffer, cfg = parts

    def run(procs: Processes) -> dict[str, float]:
        strategy = None
        if selection:
            strategy = make_strategy(cfg.strategy, buffer, 10)
            strategy.distribute(procs, True, None)
        return validate(model, corpus, dev, cfg, batch_size=2, procs=procs, strategy=strategy)

    alone = run(Processes())
    searched: list[tuple[int, int]] = []

    def counted(procs, local, row_ids, k, batch):  # every sharded top-k merges its queries' lists here
        searched.append((procs.rank, batch))
        return merge_topk(procs, local, row_ids, k, batch)

    monkeypatch.setattr(distributed, "merge_topk", counted)  # validation's own search (ShardedRows)
    monkeypatch.setattr(strategies_base, "merge_topk", counted)  # the strategy's selection
    figures = ThreadedWorld(world).run(run)
    share = -(-len(dev) // world)
    assert sorted(searched) == [(rank, share) for rank in range(world)]
    prefix = "dev_selection_" if selection else "dev_"
    assert f"{prefix}exact_match" in alone and f"{prefix}recall@5" in alone
    assert all(f == alone for f in figures), (figures, alone)
