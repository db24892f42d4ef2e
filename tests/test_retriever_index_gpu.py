"""faiss GPU placement without a GPU: the GPU-only faiss functions are replaced by fakes that behave as
faiss-gpu does (GpuCloner.cpp): the clone throws for types with no GPU version (HNSW, bare PQ), several GPUs
give an `IndexReplicas`, `index_gpu_to_cpu` turns any clone back into one CPU index, and `faiss.write_index`
cannot serialise a clone. Also: a missing faiss is reported only when an index is used."""

from __future__ import annotations

import importlib.util
import sys

import faiss
import numpy as np
import pytest
import torch

from retriever.index import PassageIndex

NOT_ON_GPU = (
    "Error in virtual faiss::Index* faiss::gpu::ToGpuCloner::clone_Index(const faiss::Index*) at "
    "/project/faiss/faiss/gpu/GpuCloner.cpp:234: This index type is not implemented on GPU."
)
# What ToGpuCloner::clone_Index knows how to put on a GPU (IndexIDMap/IndexPreTransform recurse into these).
GPU_TYPES = (faiss.IndexFlat, faiss.IndexIVFFlat, faiss.IndexIVFPQ, faiss.IndexIVFScalarQuantizer)


# What a clone answers like any index; not `this` (the C++ pointer), so faiss.write_index rejects it.
INDEX_API = {"d", "ntotal", "is_trained", "metric_type", "train", "add", "search"}


class FakeGpuIndex:
    """A GpuIndex*: a copy of the CPU index "on" `device`."""

    def __init__(self, index, device):
        self.cpu, self.device = faiss.clone_index(index), device

    def __getattr__(self, name):
        if name not in INDEX_API:
            raise AttributeError(name)
        return getattr(self.cpu, name)


class FakeIndexReplicas:
    """faiss.IndexReplicas over GPU clones: add/train on every replica, search on one."""

    def __init__(self, replicas):
        self.replicas = replicas

    def __getattr__(self, name):
        if name not in INDEX_API:
            raise AttributeError(name)
        return getattr(self.replicas[0], name)

    def train(self, x):
        for r in self.replicas:
            r.train(x)

    def add(self, x):
        for r in self.replicas:
            r.add(x)


class FakeGpu:
    """Installs the fakes on the faiss module for `ngpu` GPUs and records which devices got a clone."""

    def __init__(self, monkeypatch, ngpu):
        self.ngpu, self.devices, self.all_gpus_calls, self.to_cpu_calls = ngpu, [], 0, 0
        for name in ("LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        fakes = {
            "get_num_gpus": lambda: ngpu,
            "StandardGpuResources": lambda: "res",
            "index_cpu_to_gpu": self.index_cpu_to_gpu,
            "index_cpu_to_all_gpus": self.index_cpu_to_all_gpus,
            "index_gpu_to_cpu": self.index_gpu_to_cpu,
            "GpuParameterSpace": lambda: self,
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(faiss, name, fake, raising=False)

    def index_cpu_to_gpu(self, res, device, index, options=None):
        assert res == "res" and 0 <= device < self.ngpu
        if not isinstance(index, GPU_TYPES):
            raise RuntimeError(NOT_ON_GPU)
        self.devices.append(device)
        return FakeGpuIndex(index, device)

    def index_cpu_to_all_gpus(self, index, co=None, ngpu=-1):
        self.all_gpus_calls += 1
        clones = [self.index_cpu_to_gpu("res", d, index) for d in range(self.ngpu)]
        return clones[0] if len(clones) == 1 else FakeIndexReplicas(clones)

    def index_gpu_to_cpu(self, index):
        self.to_cpu_calls += 1
        if isinstance(index, FakeIndexReplicas):
            index = index.replicas[0]  # replicas are copies: one of them is the index
        return faiss.clone_index(index.cpu if isinstance(index, FakeGpuIndex) else index)

    def set_index_parameter(self, index, name, value):  # GpuParameterSpace
        for sub in index.replicas if isinstance(index, FakeIndexReplicas) else [index]:
            faiss.ParameterSpace().set_index_parameter(getattr(sub, "cpu", sub), name, value)


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
    assert isinstance(index.index, FakeIndexReplicas) and fake.devices == [0, 1]
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
    assert isinstance(PassageIndex.build(EMB, IDS, "Flat").index, FakeIndexReplicas)
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
