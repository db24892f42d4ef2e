"""faiss-gpu without a GPU: fakes of the GPU-only faiss functions that behave as faiss-gpu does (GpuCloner.cpp).
`FakeGpu(monkeypatch, ngpu)` installs them for `ngpu` GPUs: the clone throws for types with no GPU version
(HNSW, bare PQ), several GPUs give an `IndexReplicas` or, with the cloner option `shard`, an `IndexShards` (each
GPU a share of the rows), `index_gpu_to_cpu` turns any clone back into one CPU index, and `faiss.write_index`
cannot serialise a clone. The fakes record every clone (the rows it was given, its options) and every row added
or training done on a GPU. Used by tests/test_retriever_index_gpu.py and the tests of what runs over an index."""

from __future__ import annotations

import faiss
import numpy as np

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
