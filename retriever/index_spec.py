"""What an index over passage rows is, as data: `IndexSpec` (its faiss type, how its search is set, where it
lives) and `TwoStage` (training's two-stage selection: candidates from such an index, re-scored with h).

One description, one default, for every place that builds an index: `rlm index`, `rlm evaluate` and the demo
fill an `IndexSpec` from their command lines (`rlm.commands.index.add_index_spec_arguments`), and training reads
`strategy.two_stage` (a `TwoStage`, its `index` an `IndexSpec`) from its config. The index itself is built and
searched by `rlm.retriever.index.PassageIndex` (`apply_search` sets its search as a spec says). No torch, numpy
or faiss here: the config loads without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from rlm.retriever.errors import InputError

# What `PassageIndex.tune` aims for by default, at k = `TUNE_K` (DPR's top-20): the goal is to lose at most 1
# point of the answers exact search finds: 0.99 met it on average but not on every seed, 0.995 keeps a margin
# (docs/retriever.md, "Search parameters").
DEFAULT_TARGET_RECALL, TUNE_K = 0.995, 20
# `factory: auto` is exact (Flat) below this many rows: a search of 100k rows costs milliseconds, and exact
# search loses no answer.
AUTO_FLAT_BELOW = 100_000
AUTO_FACTORY_HELP = (
    f"auto: Flat (exact) below {AUTO_FLAT_BELOW:,} rows, else IVF with 4 sqrt(N) lists storing float16 "
    "(IVF<4 sqrt N>,SQfp16)"
)


def auto_index_factory(rows: int) -> str:
    """`factory: auto`: exact (Flat) below `AUTO_FLAT_BELOW` rows; above, IVF with 4 sqrt(N) lists (faiss's
    guideline) storing fp16 (SQfp16), like the buffer: half of Flat's memory, scores within ~1e-4 of it; its
    `nprobe` is then tuned for the spec's target recall."""
    return "Flat" if rows < AUTO_FLAT_BELOW else f"IVF{int(4 * rows**0.5)},SQfp16"


def resolve_factory(factory: str, rows: int) -> str:
    """The faiss factory string `factory` names for an index of `rows` rows (`auto` resolved)."""
    return auto_index_factory(rows) if factory == "auto" else factory


class IndexSpecError(InputError):
    """A value an `IndexSpec` or `TwoStage` refuses: `field` and what it must be (`wanted`), so that a
    config names its key and a command line its flag."""

    def __init__(self, name: str, wanted: str, value: object):
        self.field, self.wanted, self.value = name, wanted, value
        super().__init__(f"{name} must be {wanted}, got {value!r}")


def bounded(default: int | float | None, **bounds: float) -> Any:
    """A numeric field and its range beside it (ge: >=, le: <=), as `rlm.config.setting` writes one: the config
    loader reads `bounds` like its own ranges, and the class checks them when made (`_check_bounds`)."""
    return field(default=default, metadata={"bounds": bounds})


def _check_bounds(spec: object) -> None:
    """Refuse a field of `spec` outside its `bounded` range (None passes where the default is None)."""
    for each in fields(spec):
        bounds = each.metadata.get("bounds")
        value = getattr(spec, each.name)
        if bounds is None or (value is None and each.default is None):
            continue
        low, high = bounds.get("ge", -math.inf), bounds.get("le", math.inf)
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not (number and low <= value <= high and (isinstance(value, int) or each.type != "int")):
            wanted = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise IndexSpecError(each.name, wanted + (" (or null)" if each.default is None else ""), value)


@dataclass(frozen=True)
class IndexSpec:
    """An index over passage rows: its faiss type, its search (fixed, or tuned for a recall at a k), exact
    re-scoring of its candidates, and where it lives. Refuses a bad value when made (`IndexSpecError`)."""

    # faiss index_factory string (Flat, IVF1024,Flat, HNSW32, IVF4096,PQ64 ...), or auto (`auto_index_factory`).
    factory: str = "auto"
    # IVF and HNSW types: nprobe / efSearch is the smallest whose recall@`tune_k` against exact search reaches
    # this (`PassageIndex.tune`); 0 keeps faiss's defaults (1 list probed, efSearch 16).
    target_recall: float = bounded(DEFAULT_TARGET_RECALL, ge=0, le=1)
    tune_k: int = bounded(TUNE_K, ge=1)  # the k of that recall: the k the index will be searched at
    # Fixed search parameters instead of tuning them (None: tuned).
    nprobe: int | None = bounded(None, ge=1)  # IVF: inverted lists probed per query
    ef_search: int | None = bounded(None, ge=1)  # HNSW: candidates explored per query
    # Re-score each search's top `rescore` x k candidates exactly from the float16 rows the index was built
    # from (lifts the recall compressed codes cap); 0: off.
    rescore: int = bounded(0, ge=0)
    # auto: on the GPU(s) when faiss sees one (serving: when the models are on one); gpu insists; cpu: host.
    device: Literal["auto", "cpu", "gpu"] = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.factory, str) or not self.factory.strip():
            raise IndexSpecError("factory", "a faiss factory string or auto", self.factory)
        if self.device not in ("auto", "cpu", "gpu"):
            raise IndexSpecError("device", "one of auto, cpu, gpu", self.device)
        _check_bounds(self)

    def build_settings_changed(self) -> list[str]:
        """The settings that build an index (type, tuning, re-scoring) set away from the default, by name: an
        index already built (`--index DIR`) takes only the search parameters."""
        default = IndexSpec()
        built = ("factory", "target_recall", "tune_k", "rescore")
        return [name for name in built if getattr(self, name) != getattr(default, name)]

    def factory_for(self, rows: int) -> str:
        """The faiss factory string of this spec's index over `rows` rows."""
        return resolve_factory(self.factory, rows)

    @property
    def search_params(self) -> dict[str, int]:
        """The fixed search parameters, as faiss names them ({} : tuned, or nothing to tune)."""
        named = {"nprobe": self.nprobe, "efSearch": self.ef_search}
        return {name: value for name, value in named.items() if value is not None}

    @property
    def use_gpu(self) -> bool | None:
        """`PassageIndex`'s `use_gpu`: None (auto), True or False."""
        return {"auto": None, "gpu": True, "cpu": False}[self.device]

    def describe(self) -> str:
        """One line: the type and how its search is set."""
        search = ", ".join(f"{k}={v}" for k, v in self.search_params.items())
        search = search or (
            f"tuned for recall@{self.tune_k} {self.target_recall:g}"
            if self.target_recall
            else "faiss's defaults"
        )
        return f"{self.factory} ({search}{f', re-scored from the top {self.rescore} x k' if self.rescore else ''})"


@dataclass(frozen=True)
class TwoStage:
    """Appendix B.2's search (`strategy.search: two_stage`): `candidates` rows by the uncorrected score, from a
    faiss index over the rows described by `index` (`first_stage="index"`) or a streamed scan of every row
    (`"scan"`: the exact stale candidates, no index to build or hold), re-scored with h. Every `overlap_every`
    steps the exact top-k is computed beside it and its overlap logged."""

    candidates: int = bounded(1024, ge=1)
    first_stage: Literal["index", "scan"] = "index"
    overlap_every: int = bounded(100, ge=1)
    index: IndexSpec = field(default_factory=IndexSpec)

    def __post_init__(self) -> None:
        if self.first_stage not in ("index", "scan"):
            raise IndexSpecError("first_stage", "one of index, scan", self.first_stage)
        if not isinstance(self.index, IndexSpec):
            raise IndexSpecError("index", "an IndexSpec", self.index)
        _check_bounds(self)
