"""What the benchmark scripts (`scripts/bench/*.py`) share: best-of timing, latency percentiles, a training step's
phase timer, a time limit per case, peak RSS, top-k overlap, a corrector that moves vectors by a stated amount,
synthetic buffers (in memory, or written the way `rlm embed` writes them), the ring all-reduce's time, and for
steps at the paper's shapes a synthetic corpus and questions of fixed token lengths and random-init models of
T5-base's and GTR-base's shapes (no download).

The scripts import these as `lab` (a script run from scripts/bench/ has that folder on `sys.path`), never from
each other; none of it is installed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def timings(reps: int, fn: Callable[[], Any]) -> tuple[list[float], Any]:
    """Wall seconds of each of `reps` calls of `fn`, and the last result."""
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def latency_ms(seconds: Sequence[float]) -> dict[str, float]:
    """{"p50_ms", "p95_ms"}: the median and 95th percentile of `seconds`, in milliseconds."""
    ms = 1e3 * np.asarray(seconds, dtype=float)
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}


def best_of(reps: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Fewest wall seconds of `reps` calls of `fn` (the least disturbed by other jobs) and the last result."""
    times, out = timings(reps, fn)
    return min(times), out


def median_of(reps: int, fn: Callable[[], Any], warmup: bool = True) -> tuple[float, Any]:
    """Median wall seconds of `reps` calls of `fn`, after one untimed call with `warmup` (allocator and
    autocast caches), and the last result."""
    if warmup:
        fn()
    times, out = timings(reps, fn)
    return statistics.median(times), out


def overlap(found, reference) -> float:
    """Mean over queries of the fraction of `reference`'s indices (per row) that `found` also holds."""
    return float(
        np.mean(
            [len(set(x.tolist()) & set(y.tolist())) / len(y) for x, y in zip(found, reference, strict=True)]
        )
    )


def corrector_moving(dim: int, hidden: int, move: float = 0.2, seed: int = 1, num_hidden_layers: int = 1):
    """CorrectorNetwork(dim, hidden) in eval mode whose residual branch moves unit vectors by `move` on average.

    A fresh corrector's output layer is zero (h = identity), which would time a corrector that changes nothing
    and select exactly what the stale buffer selects; a trained one moves vectors by ~0.2 here
    (scripts/bench/reports/bench_retrieval/bench_retrieval.md), and 1.0 is a corrector that rewrites them.
    """
    import torch
    import torch.nn.functional as F

    from rlm.retriever.corrector import CorrectorNetwork

    torch.manual_seed(seed)
    net = CorrectorNetwork(dim, hidden, num_hidden_layers=num_hidden_layers).eval()
    with torch.no_grad():
        net.output.weight.normal_()
        probe = F.normalize(torch.randn(512, dim), dim=-1)
        net.output.weight.mul_(move / (net(probe) - probe).norm(dim=-1).mean())
    return net


def peak_rss_mb() -> float:
    """This process's peak resident set in MB: `VmHWM` of /proc/self/status (its own memory since it began),
    not getrusage's `ru_maxrss`, which Linux keeps across exec: a child process started by a large parent reports
    the parent's peak as its own (a benchmark's worker measured 6.5 GB where it used 0.94). `ru_maxrss` where
    there is no /proc (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakRSS:
    """Samples this process's RSS every few ms in a thread; `.extra_mb` = peak minus the RSS at entry."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra_mb = (self.peak - self.start) / 2**20


def write_buffer(
    folder: Path,
    n: int,
    dim: int,
    shard: Callable[[int, int], np.ndarray],
    source: str,
    claims: dict | None = None,
) -> dict:
    """A fixed buffer of `n` synthetic rows, written by `rlm.retriever.buffer`'s own writer as `rlm embed` writes
    one (shards of 100k rows with their receipts, then `finalize_buffer`: verified, ids.txt, meta.json), so
    that `PassageBuffer.load` opens it memory-mapped as training does. Shard s holds `shard(s, rows)`, an
    fp16 [rows, dim] array; `source` names the data: a folder already holding the same buffer is reused.
    `claims` overrides the buffer's `encoder_fingerprint`, `corpus_fingerprint` and `max_length` (a benchmark
    whose synthetic rows stand in for a real tower's embeddings of a real corpus, as its report says)."""
    from rlm.retriever import buffer as layout

    rows = 100_000
    settings = {
        "format_version": layout.FORMAT_VERSION,
        "encoder_fingerprint": "synthetic",
        "corpus_fingerprint": source,
        "count": n,
        "dim": dim,
        "dtype": "float16",
        "shard_size": rows,
        "num_shards": -(-n // rows),
        "max_length": 0,
        "precision": "float32",
    } | (claims or {})
    meta = folder / layout.META_NAME
    if meta.is_file() and all(json.loads(meta.read_text()).get(k) == v for k, v in settings.items()):
        return {"seconds": 0.0, "reused": True}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    start = time.perf_counter()
    for s in range(settings["num_shards"]):
        # rlm.retriever.buffer's own writer: a shard and its receipt, atomically (the format is written in one place).
        layout.write_shard(folder, s, shard(s, min(rows, n - s * rows)))
    layout.finalize_buffer(folder, range(n), settings)
    return {"seconds": time.perf_counter() - start, "reused": False}


def clustered(n: int, dim: int, cluster: int = 200, noise: float = 1.0, seed: int = 0):
    """Synthetic passage embeddings with neighbourhoods (a top-k over pure noise measures nothing): unit vectors
    around n // cluster random centres plus noise * N(0, I/dim). Returns (shard, queries): `shard(s, rows)`, an
    fp16 [rows, dim] array from its own generator (the same rows whatever writes them, in any order), and
    `queries(count)`, unit queries drawn the same way."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(max(1, n // cluster), dim, generator=g), dim=-1)

    def draw(count: int, g: torch.Generator):
        picked = torch.randint(0, len(centres), (count,), generator=g)
        return F.normalize(
            centres[picked] + torch.randn(count, dim, generator=g) * (noise / dim**0.5), dim=-1
        )

    def shard(s: int, rows: int) -> np.ndarray:
        return draw(rows, torch.Generator().manual_seed(seed * 1_000_003 + s + 1)).half().numpy()

    return shard, lambda count: draw(count, torch.Generator().manual_seed(seed + 7919))


def clustered_buffer(n: int, dim: int, queries: int, cluster: int = 200, noise: float = 1.0, seed: int = 0):
    """(an in-memory fp16 [n, dim] buffer of `clustered` rows, `queries` unit queries drawn the same way)."""
    import torch

    shard, draw = clustered(n, dim, cluster, noise, seed)
    buffer = torch.empty(n, dim, dtype=torch.float16)  # filled in place: no second copy of it all
    for s, lo in enumerate(range(0, n, 100_000)):
        buffer[lo : lo + 100_000] = torch.from_numpy(shard(s, min(100_000, n - lo)))
    return buffer, draw(queries)


class TimeLimitExceeded(BaseException):
    """A block ran past its `time_limit`. A BaseException, as KeyboardInterrupt is: library code that catches
    Exception (or OSError, which TimeoutError is) to carry on must not swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise `TimeLimitExceeded` in the block when it runs longer than `seconds` (None or 0: no limit), so that
    one slow case of a benchmark leaves time for the others. SIGALRM: the main thread of a POSIX process only;
    the alarm is seen when control is back in Python (not inside one long native call)."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise TimeLimitExceeded(f"ran past its limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def ring_allreduce_seconds(nbytes: float, devices: int, bus_bandwidth: float) -> float:
    """Seconds of a ring all-reduce of `nbytes` over `devices` at `bus_bandwidth` bytes/s, in NCCL's convention
    (nccl-tests' busbw = algorithm bandwidth x 2(p-1)/p: each byte crosses 2(p-1)/p links)."""
    return 0.0 if devices <= 1 else nbytes * 2 * (devices - 1) / devices / bus_bandwidth


# ---- synthetic text and models of the paper's shapes (scripts/bench/bench_paper_step.py) -------------------------

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def synthetic_words(count: int = 1000) -> list[str]:
    """`count` made-up two-syllable words ("bada", "bade", ...): `synthetic_tokenizer` reads each as one token."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = [a + b for a in syllables for b in syllables]
    if count > len(words):
        raise ValueError(f"at most {len(words)} synthetic words, asked for {count}")
    return words[:count]


def synthetic_tokenizer(words: Sequence[str]):
    """The project's offline reader tokenizer (`rlm.reader.tokenizer.train_tokenizer`: byte-level BPE) fitted to
    `words`, so that each of them is one token and a text of n of them is n tokens plus `</s>`: token counts, and
    so the shapes of a benchmark's batches, are set by word counts."""
    from rlm.reader.tokenizer import train_tokenizer

    lines = [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]
    return train_tokenizer(lines * 3, vocab_size=len(words) + 2000)


class SyntheticCorpus(Sequence):
    """`n` passages of `words` made-up words each, made from the row number when read (nothing is held, so
    21M rows cost nothing): a stand-in for `rlm.data.corpus.Corpus` in a training step (`corpus[i]`,
    `retrieval_texts()`)."""

    def __init__(self, n: int, words: int, vocabulary: Sequence[str], title_words: int = 2, seed: int = 0):
        self.n, self.words, self.vocabulary = n, words, list(vocabulary)
        self.title_words, self.seed = title_words, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        from rlm.data.corpus import Passage

        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not 0 <= i < self.n:
            raise IndexError(f"passage {i} out of range for {self.n} passages")
        picked = np.random.default_rng((self.seed, i)).integers(
            len(self.vocabulary), size=self.title_words + self.words
        )
        text = [self.vocabulary[w] for w in picked]
        return Passage(str(i), " ".join(text[: self.title_words]), " ".join(text[self.title_words :]))

    def retrieval_texts(self) -> Sequence[str]:
        from rlm.data.corpus import RetrievalTexts

        return RetrievalTexts(self)


def synthetic_examples(
    count: int, question_words: int, answer_words: int, vocabulary: Sequence[str], seed: int = 0
):
    """`count` QAExamples whose questions are `question_words` made-up words and answers `answer_words`."""
    from rlm.data.qa import QAExample

    rng = np.random.default_rng((seed, 1))
    words = list(vocabulary)

    def sentence(n: int) -> str:
        return " ".join(words[w] for w in rng.integers(len(words), size=n))

    return [QAExample(f"q{i}", sentence(question_words), [sentence(answer_words)]) for i in range(count)]


@dataclass(frozen=True)
class T5Shape:
    """The sizes of a T5 (t5-base by default: `T5_BASE`); the vocabulary is t5-base's 32128 rows whatever the
    tokenizer, so the embedding and LM-head costs are the paper's."""

    d_model: int = 768
    d_ff: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    vocab_size: int = 32128

    def t5_config(self, tokenizer):
        from transformers import T5Config

        if self.vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {self.vocab_size} < the tokenizer's {len(tokenizer)} tokens")
        return T5Config(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            d_kv=self.d_model // self.num_heads,
            d_ff=self.d_ff,
            num_layers=self.num_layers,
            num_decoder_layers=self.num_layers,
            num_heads=self.num_heads,
            feed_forward_proj="relu",  # t5-base and GTR-base (T5 v1.0)
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )


T5_BASE = T5Shape()
TINY_T5 = T5Shape(d_model=64, d_ff=256, num_layers=2, num_heads=4)


def t5_reader(shape: T5Shape, tokenizer, fid_config=None):
    """A FiD reader over a random-init T5 of `shape` (`T5_BASE`: the paper's T5-base reader), no download."""
    from transformers import T5ForConditionalGeneration

    from rlm.reader.fid import FiDReader

    return FiDReader(T5ForConditionalGeneration(shape.t5_config(tokenizer)), tokenizer, fid_config)


def gtr_tower(shape: T5Shape, tokenizer, max_length: int):
    """A GTR-shaped tower with random weights (`T5_BASE`: GTR-base): the T5 encoder, mean pooling, a d -> d
    Dense without bias or activation and L2 normalisation, as `sentence-transformers/gtr-t5-base` is built."""
    import torch
    from transformers import T5EncoderModel

    from rlm.retriever.encoder import SentenceEncoder

    dense = torch.nn.Linear(shape.d_model, shape.d_model, bias=False)
    model = T5EncoderModel(shape.t5_config(tokenizer))
    return SentenceEncoder(model, tokenizer, dense, "Identity", max_length=max_length)
