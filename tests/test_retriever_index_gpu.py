"""faiss GPU placement without a GPU: the GPU-only faiss functions are replaced by fakes that behave as
faiss-gpu does (GpuCloner.cpp): the clone throws for types with no GPU version (HNSW, bare PQ), several GPUs
give an `IndexReplicas` or, with the cloner option `shard`, an `IndexShards` (each GPU a share of the rows),
`index_gpu_to_cpu` turns any clone back into one CPU index, and `faiss.write_index` cannot serialise a clone.
The fakes (tests/faiss_gpu_fakes.py) record every clone (the rows it was given, its options) and every row
added or training done on a GPU. Also: a missing faiss is reported only when an index is used."""

from __future__ import annotations

import importlib.util
import sys

import faiss
import numpy as np
import pytest
import torch
from faiss_gpu_fakes import FakeGpu, FakeGpuIndex, FakeIndexShards

from rlm.retriever.index import PassageIndex


def unit_vectors(n, d, seed):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


EMB, QUERIES = unit_vectors(600, 16, 0), unit_vectors(4, 16, 1)
IDS = [f"p{i}" for i in range(600)]


@pytest.fixture
def one_thread():
    """HNSW inserts in parallel: one thread makes two builds of the same data identical."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


@pytest.mark.parametrize(
    "factory", ["HNSW16", "PQ4x4"]
)  # 4-bit codes: 16 centroids train in 0.3 s, 8-bit 6 s
def test_types_without_a_gpu_version_stay_on_cpu_with_a_notice(monkeypatch, tmp_path, one_thread, factory):
    cpu = PassageIndex.build(EMB, IDS, factory, use_gpu=False)
    fake = FakeGpu(monkeypatch, ngpu=2)
    with pytest.warns(UserWarning, match="stays on CPU.*not implemented on GPU"):
        index = PassageIndex.build(EMB, IDS, factory)
    assert isinstance(index.index, faiss.Index) and fake.devices == []
    expected = cpu.search(QUERIES, 5)
    np.testing.assert_array_equal(index.search(QUERIES, 5)[0], expected[0])
    assert index.search(QUERIES, 5)[1] == expected[1]
    index.save(tmp_path / "idx")
    assert fake.to_cpu_calls == 0, "a CPU index is written as it is, not copied"
    with pytest.warns(UserWarning, match="stays on CPU"):
        again = PassageIndex.load(tmp_path / "idx")
    assert again.search(QUERIES, 5)[1] == expected[1]


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
def test_save_of_a_multi_gpu_clone_loads_back_and_searches_identically(monkeypatch, tmp_path, factory):
    fake = FakeGpu(monkeypatch, ngpu=2)
    index = PassageIndex.build(EMB, IDS, factory)
    assert isinstance(index.index, FakeIndexShards) and fake.devices == [0, 1]
    nprobe = 8 if factory.startswith("IVF") else None
    scores, found = index.search(QUERIES, 5, nprobe=nprobe)
    index.save(tmp_path / "idx")
    assert fake.to_cpu_calls == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"], "no temporaries left behind"
    again = PassageIndex.load(tmp_path / "idx", use_gpu=False)
    assert isinstance(again.index, faiss.Index) and again.ntotal == len(IDS) and again.ids == IDS
    again_scores, again_found = again.search(QUERIES, 5, nprobe=nprobe)
    assert again_found == found
    np.testing.assert_array_equal(again_scores, scores)
    if nprobe:  # nprobe reached the GPU clone: all 8 lists probed finds the exact top-5
        exact = PassageIndex.build(EMB, IDS, "Flat", use_gpu=False)
        assert found == exact.search(QUERIES, 5)[1]


def fake_ddp_env(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")


def fake_process_group(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.parametrize("ddp", [fake_ddp_env, fake_process_group])
def test_a_ddp_rank_uses_only_its_own_gpu(monkeypatch, tmp_path, ddp):
    fake = FakeGpu(monkeypatch, ngpu=2)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a lone process (even with LOCAL_RANK set) uses every GPU
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert isinstance(PassageIndex.build(EMB, IDS, "Flat").index, FakeIndexShards)
    assert fake.all_gpus_calls == 1 and fake.devices == [0, 1]
    fake = FakeGpu(monkeypatch, ngpu=2)
    ddp(monkeypatch)
    index = PassageIndex.build(EMB, IDS, "Flat")
    assert isinstance(index.index, FakeGpuIndex) and index.index.device == 1
    index.save(tmp_path / "idx")
    again = PassageIndex.load(tmp_path / "idx")
    assert again.index.device == 1 and fake.devices == [1, 1] and fake.all_gpus_calls == 0
    assert again.search(QUERIES, 3)[1] == index.search(QUERIES, 3)[1]


def test_without_faiss_the_module_imports_and_using_an_index_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` now raises ImportError
    path = sys.modules[PassageIndex.__module__].__file__
    spec = importlib.util.spec_from_file_location("index_without_faiss", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as importing registers it (dataclasses look it up)
    spec.loader.exec_module(module)
    with pytest.raises(ImportError, match=r"rlm-corrector\[cpu\].*rlm-corrector\[gpu\]"):
        module.PassageIndex.build(EMB, IDS)


def test_searches_of_a_gpu_index_from_two_threads_never_overlap(monkeypatch):
    """faiss's StandardGpuResources are not thread-safe, and the demo answers two batches at once."""
    import threading
    import time

    FakeGpu(monkeypatch, ngpu=1)
    index = PassageIndex.build(EMB, IDS, use_gpu=True)
    assert index.on_gpu
    inside, overlaps, search = [0], [], index.index.search

    def one_at_a_time(queries, k):
        inside[0] += 1
        overlaps.append(inside[0] > 1)
        time.sleep(0.02)
        inside[0] -= 1
        return search(queries, k)

    monkeypatch.setattr(index.index, "search", one_at_a_time, raising=False)
    threads = [
        threading.Thread(target=lambda: [index.search(QUERIES, 3) for _ in range(5)]) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(overlaps) == 10 and not any(overlaps)


def test_an_ivf_index_on_a_gpu_is_tuned_through_the_gpu_parameter_space(monkeypatch):
    FakeGpu(monkeypatch, ngpu=2)
    emb = unit_vectors(2000, 16, 3)
    index = PassageIndex.build(emb, [str(i) for i in range(2000)], factory="IVF16,Flat", use_gpu=True)
    assert index.on_gpu
    tuning = index.tune(emb, target_recall=0.9, k=10, queries=100)
    assert tuning["recall"] >= 0.9 and index.search_params == {"nprobe": tuning["value"]}
    assert list(tuning["tried"]) == [str(2**i) for i in range(len(tuning["tried"]))]


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
@pytest.mark.parametrize("source", ["embeddings", "buffer"])
def test_several_gpus_get_one_clone_of_the_complete_index_its_rows_sharded_in_float16(
    monkeypatch, factory, source
):
    """Filling an index already on the GPUs grows each GPU's array a chunk at a time, the old and the new one
    alive at each step: a Flat index of 768-d rows ran out of memory near 12-13M rows on an 80 GB GPU (issue
    39). The index is built on the host and the GPUs get one clone of it, each a share of its rows in float16."""
    from rlm.retriever.buffer import PassageBuffer

    def built(use_gpu):
        if source == "buffer":
            buffer = PassageBuffer.from_embeddings(IDS, torch.from_numpy(EMB))
            return PassageIndex.from_buffer(buffer, factory, use_gpu=use_gpu, chunk_size=128)
        return PassageIndex.build(EMB, IDS, factory, use_gpu=use_gpu)

    fake = FakeGpu(monkeypatch, ngpu=2)
    index = built(None)
    assert fake.grown == [], "nothing is trained or added on a GPU"
    [(rows, trained, options)] = fake.clones
    assert (rows, trained) == (len(IDS), True), "the clone is given the complete index"
    assert options.shard and options.useFloat16 and options.reserveVecs == 0
    assert isinstance(index.index, FakeIndexShards) and [s.ntotal for s in index.index.shards] == [300, 300]
    nprobe = 8 if factory.startswith("IVF") else None
    host = built(False)
    assert index.search(QUERIES, 5, nprobe=nprobe)[1] == host.search(QUERIES, 5, nprobe=nprobe)[1]


@pytest.mark.parametrize("placement", ["one GPU", "DDP rank"])
@pytest.mark.parametrize("factory, float16", [("Flat", False), ("IVF8,PQ4x4", True)])
def test_a_one_gpu_clone_is_of_the_complete_index_flat_rows_kept_in_float32(
    monkeypatch, placement, factory, float16
):
    """On one GPU faiss turns float32 rows into float16 on the device itself: a float16 clone of a Flat index
    would briefly hold the float32 rows, their float16 copy and the result (twice the float32 size), where a
    float32 clone is one copy into an array of its final size. IVF-PQ gets float16 lookup tables."""
    fake = FakeGpu(monkeypatch, ngpu=1 if placement == "one GPU" else 2)
    if placement == "DDP rank":
        fake_ddp_env(monkeypatch)
    index = PassageIndex.build(EMB, IDS, factory)
    [(rows, trained, options)] = fake.clones
    assert fake.grown == [] and (rows, trained) == (len(IDS), True)
    assert options.useFloat16 is float16 and not getattr(options, "shard", False)
    assert isinstance(index.index, FakeGpuIndex) and index.ntotal == len(IDS)


def test_an_index_bound_for_a_gpu_is_read_whole_even_when_mapping_is_asked(monkeypatch, tmp_path):
    """`load(mmap=True)` maps only an index that stays on the host: a GPU clone is a copy of its own, made from
    the host index read whole (faiss's mapped inverted lists are no input a clone is known to take)."""
    PassageIndex.build(EMB, IDS, "IVF8,Flat", use_gpu=False).save(tmp_path / "idx")
    assert PassageIndex.load(tmp_path / "idx", use_gpu=False, mmap=True).mapped == "IO_FLAG_MMAP"
    fake = FakeGpu(monkeypatch, ngpu=1)
    index = PassageIndex.load(tmp_path / "idx", mmap=True)
    assert index.on_gpu and index.mapped is None and len(fake.devices) == 1
