"""faiss GPU placement without a GPU: the GPU-only faiss functions are replaced by fakes that behave as
faiss-gpu does (GpuCloner.cpp): the clone throws for types with no GPU version (HNSW, bare PQ), several GPUs
give an `IndexReplicas` or, with the cloner option `shard`, an `IndexShards` (each GPU a share of the rows),
`index_gpu_to_cpu` turns any clone back into one CPU index, and `faiss.write_index` cannot serialise a clone.
The fakes record every clone (the rows it was given, its options) and every row added or training done on a
GPU. Also: a missing faiss is reported only when an index is used."""

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
INDEX_API = {"d", "ntotal", "is_trained", "metric_type", "search"}


class FakeClonerOptions:
    """faiss.GpuClonerOptions (faiss-gpu only): its fields and their defaults."""

    def __init__(self):
        self.useFloat16 = self.useFloat16CoarseQuantizer = self.usePrecomputed = False
        self.reserveVecs = 0


class FakeMultipleClonerOptions(FakeClonerOptions):
    """faiss.GpuMultipleClonerOptions: a GpuClonerOptions, and whether several GPUs shard or replicate."""

    def __init__(self):
        super().__init__()
        self.shard, self.shard_type = False, 1


class FakeGpuIndex:
    """A GpuIndex*: a copy of the CPU index "on" `device`. Rows added to it and training done on it are
    recorded in `grown`: a real one reallocates its whole array at each add."""

    def __init__(self, index, device, grown):
        self.cpu, self.device, self.grown = faiss.clone_index(index), device, grown

    def __getattr__(self, name):
        if name not in INDEX_API:
            raise AttributeError(name)
        return getattr(self.cpu, name)

    def train(self, x):
        self.grown.append(("train", self.device, len(x)))
        self.cpu.train(x)

    def add(self, x):
        self.grown.append(("add", self.device, len(x)))
        self.cpu.add(x)


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


class FakeIndexShards:
    """faiss.IndexShards over GPU clones, each holding a share of the rows; a search merges their top-k. A Flat
    shard numbers its rows from 0 (`offsets`: its first row's number is added to its results); an IVF shard
    keeps the rows' own ids."""

    def __init__(self, shards, offsets):
        self.shards, self.offsets = shards, offsets

    def __getattr__(self, name):
        if name not in {"d", "is_trained", "metric_type"}:
            raise AttributeError(name)
        return getattr(self.shards[0], name)

    @property
    def ntotal(self):
        return sum(s.ntotal for s in self.shards)

    def search(self, x, k):
        found = [s.search(x, k) for s in self.shards]
        scores = np.concatenate([d for d, _ in found], axis=1)
        rows = np.concatenate([np.where(r >= 0, r + o, -1) for (_, r), o in zip(found, self.offsets)], axis=1)
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, best, 1), np.take_along_axis(rows, best, 1)


class FakeGpu:
    """Installs the fakes on the faiss module for `ngpu` GPUs and records which devices got a clone, what each
    clone was given (`clones`: the index's row count, whether it was trained, the options) and what was
    added or trained on a GPU (`grown`)."""

    def __init__(self, monkeypatch, ngpu):
        self.ngpu, self.devices, self.all_gpus_calls, self.to_cpu_calls = ngpu, [], 0, 0
        self.clones, self.grown = [], []
        for name in ("LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        fakes = {
            "get_num_gpus": lambda: ngpu,
            "StandardGpuResources": lambda: "res",
            "GpuClonerOptions": FakeClonerOptions,
            "GpuMultipleClonerOptions": FakeMultipleClonerOptions,
            "index_cpu_to_gpu": self.index_cpu_to_gpu,
            "index_cpu_to_all_gpus": self.index_cpu_to_all_gpus,
            "index_gpu_to_cpu": self.index_gpu_to_cpu,
            "GpuParameterSpace": lambda: self,
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(faiss, name, fake, raising=False)

    def index_cpu_to_gpu(self, res, device, index, options=None):
        assert res == "res" and 0 <= device < self.ngpu
        assert options is None or isinstance(options, FakeClonerOptions)  # SWIG checks the type
        self.clones.append((index.ntotal, index.is_trained, options))
        return self._clone(device, index)

    def _clone(self, device, index):
        if not isinstance(index, GPU_TYPES):
            raise RuntimeError(NOT_ON_GPU)
        self.devices.append(device)
        return FakeGpuIndex(index, device, self.grown)

    def index_cpu_to_all_gpus(self, index, co=None, ngpu=-1):
        assert co is None or isinstance(co, FakeMultipleClonerOptions)
        self.all_gpus_calls += 1
        self.clones.append((index.ntotal, index.is_trained, co))
        if co is not None and co.shard and self.ngpu > 1 and isinstance(index, GPU_TYPES):
            return self._shards(index)
        clones = [self._clone(d, index) for d in range(self.ngpu)]
        return clones[0] if len(clones) == 1 else FakeIndexReplicas(clones)

    def _shards(self, index):
        """GpuCloner's clone_Index_to_shards: a Flat index split in ranges of rows, an IVF one by row id
        modulo the GPU count (shard_type 1)."""
        n, parts, offsets = self.ngpu, [], []
        for g in range(n):
            if isinstance(index, faiss.IndexFlat):
                lo, hi = index.ntotal * g // n, index.ntotal * (g + 1) // n
                part = faiss.IndexFlat(index.d, index.metric_type)
                part.add(index.reconstruct_n(lo, hi - lo))
                offsets.append(lo)
            else:
                part, rows = faiss.clone_index(index), np.arange(index.ntotal)
                part.remove_ids(rows[rows % n != g])
                offsets.append(0)
            parts.append(self._clone(g, part))
        return FakeIndexShards(parts, offsets)

    def index_gpu_to_cpu(self, index):
        self.to_cpu_calls += 1
        if isinstance(index, FakeIndexReplicas):
            index = index.replicas[0]  # replicas are copies: one of them is the index
        if isinstance(index, FakeIndexShards):  # shards are merged into one index
            merged = faiss.clone_index(index.shards[0].cpu)
            for shard in index.shards[1:]:
                if isinstance(merged, faiss.IndexFlat):
                    merged.add(shard.cpu.reconstruct_n(0, shard.ntotal))
                else:
                    merged.merge_from(faiss.clone_index(shard.cpu), 0)
            return merged
        return faiss.clone_index(index.cpu if isinstance(index, FakeGpuIndex) else index)

    def set_index_parameter(self, index, name, value):  # GpuParameterSpace
        subs = getattr(index, "replicas", None) or getattr(index, "shards", None) or [index]
        for sub in subs:
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
    from retriever.buffer import PassageBuffer

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
