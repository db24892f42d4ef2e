"""Start-up of a many-process run at the paper's scale (issue 40, finding 5): the corpus hashed by one process,
models loaded from the hub by the main process first, a run folder or buffer that not every process sees refused
at the start, and the hard dev subcorpus built with each process embedding and receiving only its share."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import pytest
import torch
from local_port import free_port

from rlm.errors import UserError
from rlm.retriever.distributed import Processes


def tsv_corpus(folder, n: int = 30):
    path = folder / "psgs.tsv"
    lines = ["id\ttext\ttitle"] + [f"{i}\tpassage number {i}\ttitle {i}" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def process(rank: int, world: int, *replies: list) -> Processes:
    """Process `rank` of `world` alone in this test: its i-th `gather_object` puts this process's list among
    `replies[i]`, the other ranks' lists in rank order, and concatenates them as the real gather does."""
    replies = list(replies)

    def gather_object(mine: list) -> list:
        others = replies.pop(0)
        parts = [*others[:rank], mine, *others[rank:]]
        return [item for part in parts for item in part]

    return Processes(rank, world, gather_object=gather_object)


def test_only_the_first_process_hashes_the_corpus_and_the_others_take_its_fingerprint(tmp_path, hashed_files):
    from rlm.data.corpus import load_corpus

    path = tsv_corpus(tmp_path)
    sha = "dpr_tsv:sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    hashed = hashed_files
    first = load_corpus(path, procs=process(0, 2, [["(ignored)"]]))
    assert hashed == [str(path)] and first.fingerprint == sha
    other = load_corpus(path, procs=process(1, 2, [[sha]]))
    assert hashed == [str(path)], "a process other than the first hashed the corpus"
    assert other.fingerprint == sha and len(other) == 30 and other[3].text == "passage number 3"


def test_build_components_hands_the_corpus_the_run_processes(tmp_path, monkeypatch):
    import rlm.components as components
    from rlm.config import load_config

    seen = []

    def load_corpus(path, procs=None, **kwargs):
        seen.append(procs)
        raise Stop

    monkeypatch.setattr(components, "load_corpus", load_corpus)
    monkeypatch.setattr(components, "resolve_data", lambda cfg: (str(tmp_path / "corpus.jsonl"), None, None))
    accelerator = FakeAccelerator(is_main_process=False, process_index=1, num_processes=2)
    with pytest.raises(Stop):
        components.build_components(load_config(None, ["cpu=true"]), accelerator)
    assert (seen[0].rank, seen[0].world) == (1, 2)


class Stop(Exception):
    """Ends build_components where the test has seen what it looks for."""


class FakeAccelerator:
    """What build_components asks of an accelerator, recording when the main process went first."""

    def __init__(self, is_main_process: bool, process_index: int, num_processes: int):
        self.is_main_process, self.process_index, self.num_processes = (
            is_main_process,
            process_index,
            num_processes,
        )
        self.events: list[str] = []
        self.device = "cpu"

    def wait_for_everyone(self) -> None:
        return None

    @contextlib.contextmanager
    def main_process_first(self):
        self.events.append("after the main process")
        yield
        self.events.append("block done")


def test_models_are_loaded_after_the_main_process_loaded_them(monkeypatch):
    """A hub download lands once in the cache the other processes then read, not eight times at once."""
    import rlm.components as components
    from rlm.config import load_config
    from rlm.data.qa import QASplit

    accelerator = FakeAccelerator(is_main_process=False, process_index=1, num_processes=2)

    def build_retriever(cfg):
        accelerator.events.append("retriever loaded")
        raise Stop  # enough: the reader is checked below

    monkeypatch.setattr(components, "load_corpus", lambda path, procs=None: None)
    monkeypatch.setattr(components, "resolve_data", lambda cfg: ("corpus", None, None))
    monkeypatch.setattr(components, "load_train_split", lambda cfg: QASplit("toy", "train", [], "none"))
    monkeypatch.setattr(components, "load_dev_split", lambda cfg: None)
    monkeypatch.setattr(components, "build_retriever", build_retriever)
    with pytest.raises(Stop):
        components.build_components(load_config(None, ["cpu=true"]), accelerator)
    assert accelerator.events[-2:] == ["after the main process", "retriever loaded"]

    accelerator.events.clear()
    loaded = []

    def from_pretrained(path, **kwargs):
        loaded.append(list(accelerator.events))
        return "reader"

    monkeypatch.setattr(components.FiDReader, "from_pretrained", from_pretrained)
    cfg = load_config(None, ["cpu=true", "reader.path=some/hub-model"])
    assert components.build_reader(cfg, None, [], accelerator) == "reader"
    assert loaded == [["after the main process"]] and accelerator.events[-1] == "block done"


def test_a_run_folder_another_process_cannot_see_is_refused_at_the_start(tmp_path):
    from rlm.training.run import check_shared_folder

    def main_process_wrote_it():  # the barrier: by then the main process has written its probe file
        (shared / main_name).touch()

    shared, main_name = tmp_path / "shared", ".shared-probe-main"
    shared.mkdir()
    # Process 1 on a machine that sees the main process's file: nothing to say.
    procs = process(1, 2, [[main_name]], [[True]])
    procs.barrier = main_process_wrote_it
    check_shared_folder(shared, procs, "output_dir")
    # Process 1 on a machine with its own disk (a relative buffer.dir on a node's local storage).
    local = tmp_path / "this_machine_only"
    procs = process(1, 2, [[main_name]], [[True]])
    with pytest.raises(
        UserError, match=r"buffer.dir=.*this_machine_only is not on storage every process sees"
    ):
        check_shared_folder(local, procs, "buffer.dir")
    # The main process hears it from process 1 and stops too, leaving no probe behind.
    folder = tmp_path / "main"
    with pytest.raises(UserError, match=r"process\(es\) \[1\] cannot see"):
        check_shared_folder(folder, process(0, 2, [[None]], [[False]]), "output_dir")
    assert list(folder.iterdir()) == []


def _hard_subcorpus_process(rank: int, world: int, port: int, out: str) -> None:
    """One of two gloo processes: H_k over a 50-row buffer for 7 questions, the gathers it made recorded."""
    import torch.distributed as dist

    from rlm.data.qa import QAExample
    from rlm.training.hard_subcorpus import hard_subcorpus_from_buffer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        buffer, corpus, examples, tower = hard_subcorpus_world(QAExample)
        gathered = []

        def gather(tensor):
            parts = [torch.empty_like(tensor) for _ in range(world)]
            dist.all_gather(parts, tensor.contiguous())
            gathered.append(world * tensor.shape[0])
            return torch.cat(parts)

        def gather_object(items):
            parts = [None] * world
            dist.all_gather_object(parts, items)
            return [x for part in parts for x in part]

        procs = Processes(rank, world, gather, dist.barrier, gather_object)
        ids = hard_subcorpus_from_buffer(corpus, examples, tower, buffer, 3, procs)
        result = {"ids": ids, "embedded": tower.embedded, "gathered_rows": gathered}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


class FakeQueryTower:
    dim = 8

    def __init__(self):
        self.embedded = 0

    def encode(self, questions):
        self.embedded += len(questions)
        seeds = [int(hashlib.sha256(q.encode()).hexdigest()[:8], 16) for q in questions]
        return torch.stack([torch.randn(self.dim, generator=torch.Generator().manual_seed(s)) for s in seeds])


class FakeCorpus:
    def __init__(self, n: int):
        self.ids = [f"p{i}" for i in range(n)]

    def index_of(self, pid: str) -> int:
        return self.ids.index(pid)


def hard_subcorpus_world(qa_example):
    from rlm.retriever.buffer import PassageBuffer

    n = 50
    rows = torch.randn(n, FakeQueryTower.dim, generator=torch.Generator().manual_seed(0))
    buffer = PassageBuffer.from_embeddings([f"p{i}" for i in range(n)], rows)
    examples = [qa_example(str(i), f"question {i}", ["a"], [f"p{i}"] if i < 2 else []) for i in range(7)]
    return buffer, FakeCorpus(n), examples, FakeQueryTower()


@pytest.mark.slow
def test_hard_subcorpus_on_two_processes_embeds_and_gathers_each_question_once(tmp_path):
    from torch.multiprocessing import start_processes

    from rlm.data.qa import QAExample
    from rlm.training.hard_subcorpus import hard_subcorpus_from_buffer

    buffer, corpus, examples, tower = hard_subcorpus_world(QAExample)
    alone = hard_subcorpus_from_buffer(corpus, examples, tower, buffer, 3)
    start_processes(
        _hard_subcorpus_process, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["ids"] == ranks[1]["ids"] == alone  # the same H_k as one process builds
    assert [r["embedded"] for r in ranks] == [4, 3]  # each its share of the 7 questions
    # Rows gathered: the queries, 2 x 4 (each process's share, padded alike), then the top-k lists (scores, rows)
    # of every process for them, 2 x 2 x 4; not 2 x 7 and 2 x 2 x 7 as when every process asked every question.
    assert [r["gathered_rows"] for r in ranks] == [[8, 16, 16], [8, 16, 16]]
