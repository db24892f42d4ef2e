"""The retrieval benchmark runs end to end (tiny sizes) and writes its table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_retrieval_tiny(tmp_path):
    out = tmp_path / "bench"
    args = ["--sizes", "3000", "--threads", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "bench_retrieval.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    fp32, bf16 = json.loads(out.with_suffix(".json").read_text())["topk"]
    assert (fp32["n"], fp32["compute"], bf16["compute"]) == (3000, "fp32", "bf16")
    assert fp32["seconds"] > 0 and bf16["ratio_to_plain"] > 0 and fp32["stale_vs_corrected_overlap"] > 0.5
    assert "| 3,000 | fp32 |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("gpus", [0, 1])
def test_two_stage_sets_nprobe_through_the_index_on_cpu_and_on_a_gpu(monkeypatch, gpus):
    """Two-stage selection's IVF rows get their nprobe from `PassageIndex.search_rows` (ParameterSpace on CPU,
    GpuParameterSpace for a GPU clone), not from faiss's CPU ParameterSpace, which fails on a GpuIndexIVF. The
    GPU case runs on the fakes of faiss-gpu (tests/faiss_gpu_fakes.py)."""
    faiss = pytest.importorskip("faiss")
    from faiss_gpu_fakes import FakeGpu
    from lab.benchmarking import clustered_buffer, corrector_moving

    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.index import PassageIndex
    from rlm.retriever.search import two_stage_corrected_topk

    if gpus:
        FakeGpu(monkeypatch, ngpu=gpus)
    search_rows, seen = PassageIndex.search_rows, set()

    def recording(self, queries, k, nprobe=None):
        out = search_rows(self, queries, k, nprobe)
        ivf = faiss.try_extract_index_ivf(getattr(self.index, "cpu", self.index))
        seen.add((self.factory, self.on_gpu, nprobe, None if ivf is None else int(ivf.nprobe)))
        return out

    monkeypatch.setattr(PassageIndex, "search_rows", recording)
    rows, queries = clustered_buffer(2000, 64, 8, cluster=50)
    buffer = PassageBuffer.from_embeddings([str(i) for i in range(2000)], rows)
    for factory, nprobe in (("Flat", None), ("IVF16,Flat", 4)):
        index = PassageIndex.from_buffer(buffer, factory)
        top = two_stage_corrected_topk(
            queries, buffer, corrector_moving(64, 128), 8, index, 64, nprobe=nprobe
        )
        assert tuple(top.indices.shape) == (8, 8)
    assert seen == {("Flat", bool(gpus), None, None), ("IVF16,Flat", bool(gpus), 4, 4)}
