"""Passage buffer: build once, resume after a crash, split over processes, verify fingerprints, mmap."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from local_port import free_port
from local_port import torchrun as launch_torchrun
from torch import nn
from transformers import AutoTokenizer, T5Config, T5EncoderModel

from rlm.retriever.buffer import (
    BuildStopped,
    PassageBuffer,
    build_passage_buffer,
    build_settings,
    corpus_fingerprint,
    embed_shards,
    finalize_buffer,
    nonfinite_rows,
    resolve_precision,
    shards_for_rank,
)
from rlm.retriever.encoder import SentenceEncoder
from rlm.retriever.errors import InputError

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
]
IDS = [f"doc{i}" for i in range(23)]
TEXTS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(1 + (i * 5) % 17)) for i in range(23)]


@pytest.fixture(scope="module")
def encoder(minilm_path, tmp_path_factory) -> SentenceEncoder:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    tower = SentenceEncoder(
        T5EncoderModel(config), tokenizer, dense=nn.Linear(32, 16, bias=False), max_length=32
    )
    folder = tmp_path_factory.mktemp("tower")
    tower.save_pretrained(folder / "t")
    return SentenceEncoder.from_pretrained(str(folder / "t"), max_length=32)


class FailingTexts:
    """A lazy text sequence whose reads start failing after `ok_reads` reads (a crash mid-build)."""

    def __init__(self, texts, ok_reads):
        self.texts, self.ok_reads, self.reads = texts, ok_reads, 0

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads > self.ok_reads:
            raise RuntimeError("simulated crash")
        return self.texts[i]


def test_build_matches_encoder_and_keeps_order(encoder, tmp_path):
    buffer = build_passage_buffer(
        IDS, TEXTS, encoder, tmp_path / "b", batch_size=4, shard_size=10, show_progress=False
    )
    assert len(buffer) == 23 and buffer.dim == 16 and buffer.ids == IDS
    assert buffer.dtype == torch.float16
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["shards"] == ["shard_00000.npy", "shard_00001.npy", "shard_00002.npy"]
    assert meta["encoder_fingerprint"] == encoder.fingerprint()
    assert meta["corpus_fingerprint"] == corpus_fingerprint(IDS, TEXTS)
    assert not (tmp_path / "b" / "build.json").exists()
    expected = encoder.encode(TEXTS)
    torch.testing.assert_close(buffer.embeddings.float(), expected, atol=2e-3, rtol=0)
    # streamed chunks cover every row once, in order, without crossing shards
    starts = [(s, c.shape[0]) for s, c in buffer.iter_chunks(4)]
    assert starts == [(0, 4), (4, 4), (8, 2), (10, 4), (14, 4), (18, 2), (20, 3)]
    rows = torch.tensor([[22, 0], [10, 9]])
    torch.testing.assert_close(buffer.rows(rows), buffer.embeddings[rows])
    assert buffer.index_of("doc10") == 10
    # rebuilding a complete buffer is a no-op load
    again = build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "b", shard_size=10, show_progress=False)
    assert torch.equal(again.embeddings, buffer.embeddings)


def test_loaded_buffer_is_memory_mapped_and_moves(encoder, tmp_path):
    build_passage_buffer(
        IDS, TEXTS, encoder, tmp_path / "b", dtype="float32", shard_size=100, show_progress=False
    )
    buffer = PassageBuffer.load(tmp_path / "b")
    assert buffer.embeddings.dtype == torch.float32
    shard = (tmp_path / "b" / "shard_00000.npy").resolve()
    if Path("/proc/self/maps").exists():
        assert str(shard) in Path("/proc/self/maps").read_text(), "the shard must be memory-mapped, not read"
    torch.testing.assert_close(buffer.embeddings, torch.from_numpy(np.load(shard)))
    moved = buffer.to("cpu", dtype=torch.bfloat16)
    assert moved.embeddings.dtype == torch.bfloat16 and moved.ids == buffer.ids


def test_load_refuses_other_encoder_or_corpus(encoder, tmp_path):
    build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "b", shard_size=10, show_progress=False)
    with pytest.raises(ValueError, match="encoder fingerprint .* but the encoder given has fingerprint abc"):
        PassageBuffer.load(tmp_path / "b", encoder_fingerprint="abc")
    other = corpus_fingerprint(IDS, TEXTS[:-1] + ["changed"])
    with pytest.raises(ValueError, match=f"corpus given has fingerprint {other}"):
        PassageBuffer.load(tmp_path / "b", corpus_fingerprint=other)
    with pytest.raises(FileNotFoundError, match="rlm embed"):
        PassageBuffer.load(tmp_path / "nothing")


def test_interrupted_build_resumes_keeping_complete_shards(encoder, tmp_path):
    out = tmp_path / "b"
    crash_after_two_shards = FailingTexts(TEXTS, ok_reads=len(TEXTS) + 20)  # fingerprint + shards 0 and 1
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_passage_buffer(IDS, crash_after_two_shards, encoder, out, shard_size=10, show_progress=False)
    assert (out / "build.json").exists() and not (out / "meta.json").exists()
    assert sorted(p.name for p in out.glob("shard_*.npy")) == ["shard_00000.npy", "shard_00001.npy"]
    with pytest.raises(FileNotFoundError, match="unfinished"):
        PassageBuffer.load(out)
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.npy")}

    settings = build_settings(IDS, TEXTS, encoder, "float16", 10)
    redone = embed_shards(IDS, TEXTS, encoder, out, settings, range(3), show_progress=False)
    assert redone == [2], "complete shards must be kept"
    finalize_buffer(out, IDS, settings)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard_0000[01].npy")} == kept
    resumed = PassageBuffer.load(out)
    fresh = build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "fresh", shard_size=10, show_progress=False)
    assert torch.equal(resumed.embeddings, fresh.embeddings)


def test_corrupt_shard_is_reembedded_and_other_settings_refused(encoder, tmp_path):
    out = tmp_path / "b"
    with pytest.raises(RuntimeError):
        build_passage_buffer(
            IDS, FailingTexts(TEXTS, len(TEXTS) + 20), encoder, out, shard_size=10, show_progress=False
        )
    array = np.load(out / "shard_00001.npy")
    array[0, 0] += 1
    np.save(out / "shard_00001.npy", array)
    settings = build_settings(IDS, TEXTS, encoder, "float16", 10)
    assert embed_shards(IDS, TEXTS, encoder, out, settings, range(3), show_progress=False) == [1, 2]
    with pytest.raises(ValueError, match="unfinished build with other settings.*shard_size"):
        build_passage_buffer(IDS, TEXTS, encoder, out, shard_size=5, show_progress=False)


def test_two_ranks_share_the_shards(encoder, tmp_path):
    assert shards_for_rank(5, 0, 2) == [0, 2, 4] and shards_for_rank(5, 1, 2) == [1, 3]
    with pytest.raises(ValueError, match="rank=2"):
        shards_for_rank(5, 2, 2)
    out = tmp_path / "b"
    out.mkdir()
    settings = build_settings(IDS, TEXTS, encoder, "float16", 5)
    assert embed_shards(
        IDS, TEXTS, encoder, out, settings, shards_for_rank(5, 1, 2), show_progress=False
    ) == [1, 3]
    with pytest.raises(ValueError, match=r"shards \[0, 2, 4\] are missing"):
        finalize_buffer(out, IDS, settings)
    assert embed_shards(
        IDS, TEXTS, encoder, out, settings, shards_for_rank(5, 0, 2), show_progress=False
    ) == [0, 2, 4]
    finalize_buffer(out, IDS, settings)
    single = build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "one", shard_size=5, show_progress=False)
    assert torch.equal(PassageBuffer.load(out).embeddings, single.embeddings)


@pytest.mark.slow
def test_two_processes_under_torchrun_build_the_one_process_buffer_and_rlm_embed_splits_the_work(
    encoder, tmp_path
):
    """A real 2-process (gloo, CPU) build under torchrun: the library's `build_passage_buffer` with accelerate's
    PartialState (every rank gets the finished buffer back), then `rlm embed` in the same two processes (one
    summary, from the main rank); both buffers are the one-process buffer. One launch for both: a process
    start is ~8 CPU-s of imports."""
    tower = tmp_path / "tower"
    encoder.save_pretrained(tower)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": i, "title": "", "text": t}) + "\n" for i, t in zip(IDS, TEXTS))
    )
    embed = ["embed", "--corpus", str(corpus), "--encoder", str(tower), "--out", str(tmp_path / "cli")]
    embed += ["--shard-size", "6", "--max-length", "32", "--no-progress"]
    script = tmp_path / "build.py"
    script.write_text(
        "import sys, torch\n"
        "from accelerate import PartialState\n"
        "from rlm.retriever.buffer import build_passage_buffer\n"
        "from rlm.retriever.encoder import SentenceEncoder\n"
        "from rlm.cli import main\n"
        "torch.set_num_threads(1)\n"
        "state = PartialState(cpu=True)\n"
        f"ids = {IDS!r}\ntexts = {TEXTS!r}\n"
        "enc = SentenceEncoder.from_pretrained(sys.argv[1], max_length=32)\n"
        "buf = build_passage_buffer(ids, texts, enc, sys.argv[2], shard_size=6, accelerator=state, show_progress=False)\n"
        "open(f'{sys.argv[2]}.rank{state.process_index}', 'w').write(str(len(buf)))\n"
        f"sys.exit(main({embed!r}))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [*launch_torchrun(2), str(script), str(tower), str(tmp_path / "b")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):  # both ranks ran distributed and returned the finished buffer
        assert Path(f"{tmp_path / 'b'}.rank{rank}").read_text() == "23"
    assert done.stdout.count("23 passages x 16") == 1, done.stdout
    single = build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "one", shard_size=6, show_progress=False)
    for built in ("b", "cli"):
        assert torch.equal(PassageBuffer.load(tmp_path / built).embeddings, single.embeddings), built


class CountingTexts:
    """A text sequence that counts its reads: how many passages a load or build really touched."""

    def __init__(self, texts):
        self.texts, self.reads = texts, 0

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        self.reads += 1
        return self.texts[i]


NEW_FINGERPRINT = "jsonl:sha256:" + "ab" * 32


def test_given_corpus_fingerprint_is_recorded_without_a_pass_over_the_texts(encoder, tmp_path):
    texts = CountingTexts(TEXTS)
    buffer = build_passage_buffer(
        IDS,
        texts,
        encoder,
        tmp_path / "b",
        shard_size=10,
        show_progress=False,
        corpus_fingerprint=NEW_FINGERPRINT,
    )
    assert texts.reads == len(TEXTS)  # the embedding pass only, no fingerprint pass
    assert buffer.meta["corpus_fingerprint"] == NEW_FINGERPRINT
    PassageBuffer.load(tmp_path / "b", corpus_fingerprint=NEW_FINGERPRINT)
    with pytest.raises(ValueError, match="corpus given has fingerprint jsonl:sha256:cd"):
        PassageBuffer.load(tmp_path / "b", corpus_fingerprint="jsonl:sha256:" + "cd" * 32)


def test_loaded_ids_are_one_blob(encoder, tmp_path):
    from rlm.retriever.ids import IdSequence

    build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "b", shard_size=10, show_progress=False)
    buffer = PassageBuffer.load(tmp_path / "b")
    assert isinstance(buffer.ids, IdSequence) and buffer.ids == IDS and buffer.ids[22] == "doc22"
    assert (tmp_path / "b" / "ids.txt").read_text() == "\n".join(IDS)  # the file format is unchanged
    assert buffer.index_of("doc7") == 7
    with pytest.raises(ValueError, match="line break"):
        finalize_buffer(
            tmp_path / "b", ["a\nb"] + IDS[1:], {**buffer.meta, "num_shards": 3, "shard_size": 10}
        )


def test_nonfinite_rows_finds_nan_and_inf_in_any_chunk_and_nothing_else():
    rows = np.zeros((50, 6), dtype=np.float16)
    rows[3, 0], rows[17, 5], rows[49, 2] = np.nan, np.inf, -np.inf
    rows[20] = 65504  # float16's largest finite value is finite
    for array in (rows, rows.astype(np.float32), rows.astype(np.float64)):
        for chunk_rows in (1, 7, 4096):
            assert nonfinite_rows(array, chunk_rows).tolist() == [3, 17, 49]
    assert nonfinite_rows(np.ones((5, 3), dtype=np.float16)).size == 0


def test_a_tower_that_gives_nan_is_refused_naming_the_passages(encoder, tmp_path, monkeypatch):
    """A NaN row scores NaN for every query and ranks first in every top-k: refused before its shard is
    written, so the rerun with a working tower embeds that shard again."""
    out = tmp_path / "b"
    forward = encoder.forward
    target = encoder.tokenize([TEXTS[12]])["input_ids"][0]

    def broken(input_ids, attention_mask):
        vectors = forward(input_ids, attention_mask)
        width = min(len(target), input_ids.shape[1])
        hit = (input_ids[:, :width] == target[:width]).all(dim=1) & (attention_mask.sum(dim=1) == len(target))
        vectors[hit] = float("nan")
        return vectors

    monkeypatch.setattr(encoder, "forward", broken)
    with pytest.raises(InputError, match=r"shard 1: 1 buffer row\(s\) hold NaN .*'doc12' \(row 12\)"):
        build_passage_buffer(IDS, TEXTS, encoder, out, shard_size=10, show_progress=False)
    assert (out / "shard_00000.npy").exists() and not (out / "shard_00001.npy").exists()
    monkeypatch.setattr(encoder, "forward", forward)
    buffer = build_passage_buffer(IDS, TEXTS, encoder, out, shard_size=10, show_progress=False)
    assert torch.isfinite(buffer.embeddings).all()


def test_verification_refuses_a_shard_with_nonfinite_rows(encoder, tmp_path):
    """A shard with an intact receipt but an infinite row (written before the check, or by hand) is refused
    when the build is finalized, and no meta.json makes it a buffer."""
    from rlm.retriever.buffer import write_shard

    out = tmp_path / "b"
    settings = build_settings(IDS, TEXTS, encoder, "float16", 10)
    out.mkdir()
    embed_shards(IDS, TEXTS, encoder, out, settings, range(3), show_progress=False)
    array = np.load(out / "shard_00002.npy")
    array[1, 0] = np.inf
    write_shard(out, 2, array)
    with pytest.raises(InputError, match=r"shard_00002.npy: 1 buffer row.*'doc21' \(row 21\).*delete"):
        finalize_buffer(out, IDS, settings)
    assert not (out / "meta.json").exists()


def test_each_batch_is_one_forward_of_the_shard_sorted_by_token_length(encoder, tmp_path, monkeypatch):
    """A shard is sorted by token length as a whole and each batch is one forward padded to its own longest
    row: not split into forwards of 16 (which left a GPU idle), and padded little. A CPU, fastest at forwards
    of 16 rows, splits a batch into those."""
    import rlm.retriever.encoder

    forward = encoder.forward
    calls = []

    def recording(input_ids, attention_mask):
        calls.append((input_ids.shape[1], attention_mask.sum(dim=1).tolist()))
        return forward(input_ids, attention_mask)

    monkeypatch.setattr(encoder, "forward", recording)
    build_passage_buffer(
        IDS, TEXTS, encoder, tmp_path / "cpu", batch_size=20, shard_size=23, show_progress=False
    )
    assert [len(lengths) for _, lengths in calls] == [16, 7]
    calls.clear()
    monkeypatch.setattr(
        rlm.retriever.encoder, "CPU_BUCKET_SIZE", 10**6
    )  # as on an accelerator: whole batches
    buffer = build_passage_buffer(
        IDS, TEXTS, encoder, tmp_path / "b", batch_size=20, shard_size=23, show_progress=False
    )
    assert [len(lengths) for _, lengths in calls] == [20, 3]
    assert all(width == max(lengths) for width, lengths in calls)
    lengths = [n for _, batch in calls for n in batch]
    assert lengths == sorted(lengths, reverse=True)
    monkeypatch.setattr(encoder, "forward", forward)
    torch.testing.assert_close(buffer.embeddings.float(), encoder.encode(TEXTS), atol=2e-3, rtol=0)


def test_auto_precision_is_bf16_on_a_cuda_gpu_and_float32_elsewhere(monkeypatch):
    assert resolve_precision("auto", "cpu") == "float32"
    assert resolve_precision("bf16", "cpu") == "bf16" and resolve_precision("float32", "cuda") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert resolve_precision("auto", "cuda:1") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert resolve_precision("auto", "cuda") == "float32"
    with pytest.raises(InputError, match="precision must be"):
        resolve_precision("fp16", "cpu")


def test_a_bf16_buffer_is_never_taken_for_a_float32_one(encoder, tmp_path):
    """bf16 autocast gives other values: the precision is one of the buffer's settings, so a bf16 buffer is
    not loaded where float32 is asked for, not returned by a float32 build, and not resumed as one."""
    fp32 = build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "fp32", shard_size=10, show_progress=False)
    bf16 = build_passage_buffer(
        IDS, TEXTS, encoder, tmp_path / "bf16", shard_size=10, precision="bf16", show_progress=False
    )
    assert fp32.meta["precision"] == "float32" and bf16.meta["precision"] == "bf16"
    assert not torch.equal(fp32.embeddings, bf16.embeddings)
    torch.testing.assert_close(bf16.embeddings.float(), fp32.embeddings.float(), atol=5e-2, rtol=0)
    assert PassageBuffer.load(tmp_path / "bf16", precision="bf16").meta["precision"] == "bf16"
    with pytest.raises(InputError, match="built with the passage tower in bf16, not float32"):
        PassageBuffer.load(tmp_path / "bf16", precision="float32")
    with pytest.raises(InputError, match="complete buffer with other settings.*precision: folder has bf16"):
        build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "bf16", shard_size=10, show_progress=False)
    out = tmp_path / "unfinished"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_passage_buffer(
            IDS,
            FailingTexts(TEXTS, len(TEXTS) + 10),
            encoder,
            out,
            shard_size=10,
            precision="bf16",
            show_progress=False,
        )
    with pytest.raises(InputError, match="unfinished build with other settings.*precision: folder has bf16"):
        build_passage_buffer(IDS, TEXTS, encoder, out, shard_size=10, show_progress=False)


def test_a_callers_autocast_does_not_change_a_float32_build(encoder, tmp_path):
    plain = build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "plain", shard_size=10, show_progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = build_passage_buffer(
            IDS, TEXTS, encoder, tmp_path / "inside", shard_size=10, show_progress=False
        )
    assert inside.meta["precision"] == "float32" and torch.equal(inside.embeddings, plain.embeddings)


def test_a_stopped_build_does_not_wait_for_the_next_shard_being_read(encoder, tmp_path):
    """The next shard is read and tokenized in a background thread; a stop signal raised between batches
    ends the build at once, not after that read (a scheduler's grace period is short)."""
    release = threading.Event()

    class SlowTexts:
        def __len__(self):
            return len(TEXTS)

        def __getitem__(self, i):
            if i >= 10:  # shard 1 and after: a read that takes as long as the test lets it
                release.wait(60)
            return TEXTS[i]

    class Stop(Exception):
        pass

    checks = []

    def check():
        checks.append(len(checks))
        if len(checks) == 2:
            raise Stop

    started = time.perf_counter()
    try:
        with pytest.raises(Stop):
            build_passage_buffer(
                IDS,
                SlowTexts(),
                encoder,
                tmp_path / "b",
                batch_size=5,
                shard_size=10,
                corpus_fingerprint="test:slow",
                check=check,
                show_progress=False,
            )
        assert time.perf_counter() - started < 30
    finally:
        release.set()
    for thread in threading.enumerate():
        if thread.name.startswith("buffer-tokenize"):
            thread.join(timeout=30)
            assert not thread.is_alive()


def _stopped_build_process(rank: int, world: int, port: int, tower: str, out: str) -> None:
    """One of two gloo processes building a 5-shard buffer, two rows a forward: rank 1's check stops it at its
    second batch (a stop signal), while rank 0 embeds all three of its shards. Writes how the build ended."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )

    class Processes:  # what the build uses of accelerate's state
        process_index, num_processes, is_main_process, device = rank, world, rank == 0, torch.device("cpu")

        def wait_for_everyone(self):
            dist.barrier()

    batches = []

    def check():
        batches.append(1)
        if rank == 1 and len(batches) == 2:
            raise BuildStopped("stopped by SIGTERM")

    encoder = SentenceEncoder.from_pretrained(tower, max_length=32)
    started = time.monotonic()
    try:
        build_passage_buffer(
            IDS,
            TEXTS,
            encoder,
            out,
            batch_size=2,
            shard_size=5,
            accelerator=Processes(),
            check=check,
            show_progress=False,
        )
        ended = "built"
    except BuildStopped as err:
        ended = str(err)
    except Exception as err:  # a process left waiting for another at the meeting point
        ended = f"{type(err).__name__}: {err}"
    result = {"ended": ended, "batches": len(batches), "seconds": time.monotonic() - started}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_build_stopped_on_one_process_stops_every_process_at_its_meeting_point_and_a_rerun_resumes(
    encoder, tmp_path
):
    """A stop on one process must not leave the others waiting for it until the process group's timeout: all
    leave the build together, the shards already written stay, and a rerun finishes the buffer."""
    from torch.multiprocessing import start_processes

    tower, out = tmp_path / "tower", tmp_path / "b"
    encoder.save_pretrained(tower)
    start_processes(
        _stopped_build_process, args=(2, free_port(), str(tower), str(out)), nprocs=2, start_method="spawn"
    )
    rank0, rank1 = (json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1))
    assert rank1 == {**rank1, "ended": "stopped by SIGTERM", "batches": 2}
    assert rank0["ended"] == "another process stopped the build" and rank0["seconds"] < 50, rank0
    assert rank0["batches"] == 8  # shards 0, 2 and 4: 5 + 5 + 3 rows, two a forward
    assert not (out / "meta.json").exists()
    resumed = build_passage_buffer(IDS, TEXTS, encoder, out, shard_size=5, show_progress=False)
    single = build_passage_buffer(IDS, TEXTS, encoder, tmp_path / "one", shard_size=5, show_progress=False)
    assert torch.equal(resumed.embeddings, single.embeddings)
