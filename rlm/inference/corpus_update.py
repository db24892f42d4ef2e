"""`rlm corpus update`: add, replace and delete passages of an indexed corpus without re-embedding the rest.

An update embeds only its added and changed passages, with the encoder the index's rows came from (the trained
passage tower for an index of the re-embedded corpus; the starting encoder g0 then the corrector h for an index
over h(B), which is how the corrector keeps a never re-embedded buffer usable: a new passage embedded by g0
joins B and h corrects it like every other row). Their rows are added to the faiss index with the codebooks it
was trained with; the rows of replaced and deleted passages become unreachable (`PassageIndex.remove_rows`).
The passages and their float16 rows are kept in the index folder (`updates/<n>/`: `passages.jsonl`,
`deleted.txt`, `rows.npy`), the corpus file and the buffer stay as they are, and index.json records the edition:
the base corpus's fingerprint and each update's, chained (`rlm.data.corpus_edition`).

Nothing is half-applied: the store and the new index files are written first under names no index.json names,
then index.json is replaced in one rename (`PassageIndex.save_generation`). A process killed before that leaves
the index as it was; the next update deletes what it left (`orphans`) and starts again.

After each update two checks say whether the index has outgrown its tuning: the new rows' quantization error
against the error on the sample the codebooks were trained on (`QUANTIZATION_LIMIT` times it: the codes fit
the new rows worse), and the share of made questions (`question_like_rows`) on new rows whose source passage
the tuned search still finds (`RECALL_MARGIN` below the tuned recall). Past either, the update says to rebuild
the codebooks from the current rows: `rlm index --retrain DIR`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlm.base.atomicio import atomic_file, atomic_write_text
from rlm.data.corpus import Corpus
from rlm.data.corpus_edition import (
    CorpusEdition,
    chained,
    new_record,
    open_edition_record,
    read_deletions,
    update_fingerprint,
)
from rlm.errors import UnknownPassageError, UserError

STORES = "updates"
QUANTIZATION_LIMIT = 1.5  # the new rows' quantization error at most this many times the training sample's
RECALL_MARGIN = 0.02  # made questions on new rows found at most this much below the tuned recall
RECHECK_QUESTIONS = 256  # made questions per check (new rows, and as many old ones)


@dataclass
class UpdateResult:
    """What one update did and found."""

    number: int
    added: int
    replaced: int
    deleted: int
    rows: int  # the index's rows after it, removed ones included
    live: int  # rows a search can return
    fingerprint: str  # the edition's, after it
    seconds: dict[str, float] = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass
class RowEncoder:
    """What embeds an update's passages as the index's rows were embedded: the passage `tower` (float16 rows
    through the buffer's own path, in the `precision` the rows were made in), then the `corrector` h for an
    index over h(B). `fingerprint`: the encoder's, which the index records."""

    tower: object
    fingerprint: str
    precision: str = "auto"
    corrector: object = None
    batch_size: int = 64
    dtype: str = "float16"  # the rows' (a buffer's own: float16 or float32)

    def embed(self, texts) -> np.ndarray:
        import torch

        from rlm.inference.corrected_index import CorrectedRows
        from rlm.retriever.buffer import PassageBuffer, embed_passages

        rows = embed_passages(
            self.tower, texts, batch_size=self.batch_size, dtype=self.dtype, precision=self.precision
        )
        if self.corrector is None or not len(rows):
            return rows
        # Through h as the index's own h(B) rows went (`CorrectedRows`): the same cast and device, a chunk a time.
        stale = PassageBuffer.from_embeddings(range(len(rows)), torch.from_numpy(rows))
        corrected = [block for _, block in CorrectedRows(stale, self.corrector).iter_chunks(4096)]
        return torch.cat(corrected).numpy().astype(np.float16)


def row_encoder(
    index, index_dir, checkpoint=None, encoder=None, device=None, batch_size: int = 64
) -> RowEncoder:
    """The encoder of `index`'s rows, from `checkpoint` (its trained passage tower; or, for an index over
    h(B), the run's starting encoder g0 and its corrector) or from `encoder` (a sentence-transformers folder),
    refused unless its fingerprint is the one the index records."""
    recorded = index.provenance.get("encoder_fingerprint")
    if recorded is None:
        raise UserError(
            f"index {index_dir} records no encoder (built from bare embeddings, `rlm index --embeddings`): an "
            "update could not check what embeds its passages; build it from a buffer (`rlm embed`, then `rlm "
            "index --buffer`)"
        )
    precision = index.provenance.get("precision") or "auto"
    if encoder is not None:
        max_length = index.provenance.get("max_length")
        how = (precision, max_length, "float16")
        return _from_folder(f"index {index_dir}", encoder, recorded, how, device, batch_size)
    from rlm.inference.checkpoint import load_checkpoint

    retriever, _, _ = load_checkpoint(checkpoint, need_reader=False, device=device)
    tower = retriever.passage_tower
    if tower.fingerprint() == recorded:
        return RowEncoder(tower, recorded, precision, batch_size=batch_size)
    if index.provenance.get("corrector_fingerprint"):
        return _corrected(index_dir, index, checkpoint, recorded, precision, device, batch_size)
    raise UserError(
        f"index {index_dir} holds rows of encoder {recorded}, not of {checkpoint}'s passage tower "
        f"({tower.fingerprint()}): update it with the checkpoint (or `--encoder`) its rows were embedded with"
    )


def _from_folder(where: str, folder, recorded: str, how: tuple, device, batch_size: int) -> RowEncoder:
    """The encoder in `folder` at the max length the rows of `where` were embedded at (`how`: precision, max
    length, the rows' dtype)."""
    from rlm.retriever.encoder import SentenceEncoder

    precision, max_length, dtype = how
    path = Path(folder) / "passage_tower" if (Path(folder) / "passage_tower").is_dir() else Path(folder)
    # A trained tower's folder holds its own length; a bare encoder is taken at the length of the rows.
    trained = (Path(folder) / "passage_tower").is_dir()
    tower = SentenceEncoder.from_pretrained(str(path), max_length=None if trained else max_length)
    if device is not None:
        tower.to(device)
    if tower.fingerprint() != recorded:
        raise UserError(
            f"{where} holds rows of encoder {recorded}, not of {folder} ({tower.fingerprint()}): "
            "update it with the encoder its rows were embedded with"
        )
    return RowEncoder(tower, recorded, precision, batch_size=batch_size, dtype=dtype)


def _corrected(
    index_dir, index, checkpoint, recorded: str, precision: str, device, batch_size: int
) -> RowEncoder:
    """g0 (the run's starting passage tower, rebuilt from its config) then h, for an index over h(B)."""
    from rlm.components import starting_passage_tower
    from rlm.inference.corrected_index import corrector_fingerprint
    from rlm.retriever.corrector import CorrectorNetwork

    start = starting_passage_tower(checkpoint)
    found = (start.fingerprint(), corrector_fingerprint(checkpoint))
    wanted = (recorded, index.provenance["corrector_fingerprint"])
    if found != wanted:
        raise UserError(
            f"index {index_dir} holds h(B) rows of encoder {wanted[0]} and corrector {wanted[1]}, not {checkpoint}'s "
            f"({found[0]}, {found[1]}): update it with the checkpoint whose corrector made it"
        )
    corrector = CorrectorNetwork.from_pretrained(Path(checkpoint) / "corrector").eval()
    if device is not None:
        start.to(device)
        corrector.to(device)
    return RowEncoder(start, recorded, precision, corrector, batch_size)


def orphans_removed(index_dir) -> list[Path]:
    """Delete what an update killed before its commit left in `index_dir` (files and stores its index.json
    does not name, `rlm.retriever.index.orphans`); returns them."""
    from rlm.retriever.index import orphans

    return _deleted(orphans(index_dir) if (Path(index_dir) / "index.json").exists() else [])


def _deleted(paths: list[Path]) -> list[Path]:
    """Delete `paths` (files and folders); returns them."""
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return paths


def open_edition(index_dir, index, base: Corpus) -> CorpusEdition:
    """The corpus `index` serves: `base` and the passages of each update in `index_dir`, every update's files
    checked against the fingerprint it was applied with, and the chain against index.json's."""
    return open_edition_record(index_dir, index.edition, base, index.removed)


def _plan(edition, added: Corpus | None, deletions: list[tuple[int, str]], add_path, delete_path):
    """(rows the added passages replace, rows deleted), each id checked: a deleted id must be live; an id
    both added and deleted is refused."""
    replaced, deleted = [], []
    added_ids = set(added.ids) if added is not None else set()
    for pid in sorted(added_ids):
        with contextlib.suppress(UnknownPassageError):  # else a new passage
            replaced.append(edition.index_of(pid))
    for number, pid in deletions:
        if pid in added_ids:
            raise UserError(
                f"{delete_path}:{number}: passage id {pid!r} is also in {add_path}: add it or delete it"
            )
        try:
            deleted.append(edition.index_of(pid))
        except UnknownPassageError:
            raise UserError(
                f"{delete_path}:{number}: passage id {pid!r} is not in the corpus (or an earlier update deleted "
                "it); remove the line and run the update again"
            ) from None
    return replaced, deleted


def _write_store(store: Path, added: Corpus | None, add_path, deletions, vectors: np.ndarray) -> None:
    """The update's own copy of what it applied: its passages file byte for byte, its deletions, its rows."""
    store.mkdir(parents=True, exist_ok=True)
    if added is not None:
        with atomic_file(store / "passages.jsonl") as path:
            shutil.copyfile(add_path, path)
    atomic_write_text(store / "deleted.txt", "".join(f"{pid}\n" for _, pid in deletions))
    with atomic_file(store / "rows.npy") as path, open(path, "wb") as f:
        np.save(f, vectors)


def update_entry(result: UpdateResult, store: str, fp: str, encoder_fp: str, first_row: int) -> dict:
    """What an edition records of one update (index.json's `edition`, a buffer's edition.json)."""
    return {
        "number": result.number,
        "store": store,
        "fingerprint": fp,
        "encoder_fingerprint": encoder_fp,
        "added": result.added,
        "replaced": result.replaced,
        "deleted": result.deleted,
        "first_row": first_row,
        "rows": result.added + result.replaced,
        "applied": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checks": result.checks,
    }


def _commit(
    index, index_dir: Path, result: UpdateResult, store: str, encoder_fp: str, first_row: int, fp: str
):
    """Record the update in the index's edition and save it as the next generation (the one rename)."""
    edition = index.edition
    edition["updates"].append(update_entry(result, store, fp, encoder_fp, first_row))
    edition["fingerprint"] = result.fingerprint
    # The folder's next generation: after `rlm index --retrain` it is past the number of updates.
    generation = json.loads((index_dir / "index.json").read_text()).get("generation", 0) + 1
    index.save_generation(index_dir, generation)


@dataclass
class UpdatePlan:
    """An update read and checked against the corpus, before anything is embedded or written."""

    edition: CorpusEdition  # the corpus before it
    added: Corpus | None  # its passages file, parsed (a malformed line named by file and line)
    add_path: Path | None
    deletions: list[tuple[int, str]]  # (line, id) of its deletions file
    delete_path: Path | None
    replaced: list[int]  # live rows the added passages replace
    deleted: list[int]  # live rows deleted


def plan_update(index_dir, index, base: Corpus, add_path=None, delete_path=None) -> UpdatePlan:
    """Read `add_path` (JSONL `{id, title, text}`; an id the corpus has replaces that passage) and
    `delete_path` (ids, one a line) against the corpus `index` serves now; refuse what cannot be applied."""
    if not index.edition:
        index.edition = new_record(base)
    edition = open_edition(index_dir, index, base)
    add_path = Path(add_path) if add_path else None
    delete_path = Path(delete_path) if delete_path else None
    added = Corpus(add_path) if add_path else None
    deletions = read_deletions(delete_path) if delete_path else []
    replaced, deleted = _plan(edition, added, deletions, add_path, delete_path)
    return UpdatePlan(edition, added, add_path, deletions, delete_path, replaced, deleted)


def _embedded(plan: UpdatePlan, encoder, edition: dict, dim: int, dtype: str):
    """(the update's `UpdateResult` so far, its rows embedded by `encoder` [n, dim], its fingerprint): what an
    update of an index and of a buffer do alike before they store it."""
    added = plan.added
    new = (len(added) if added else 0) - len(plan.replaced)
    number = len(edition["updates"]) + 1
    result = UpdateResult(number, new, len(plan.replaced), len(plan.deleted), 0, 0, "")
    started = time.perf_counter()
    vectors = encoder.embed(added.retrieval_texts()) if added else np.zeros((0, dim), dtype)
    result.seconds["embed"] = time.perf_counter() - started
    deleted_ids = [pid for _, pid in plan.deletions]
    fp = update_fingerprint(added.fingerprint if added else "", deleted_ids, encoder.fingerprint)
    result.fingerprint = chained(edition["fingerprint"], fp)
    return result, vectors, fp


def update_index(
    index_dir, base: Corpus, add=None, delete=None, checkpoint=None, encoder=None, device=None, batch_size=64
) -> tuple[UpdateResult, list[Path]]:
    """`rlm corpus update --index`: what an interrupted update left in `index_dir` deleted, the index checked
    against the base corpus, the update read against it (bad input refused before any model loads), its
    passages embedded by the encoder of the index's rows (`row_encoder`: from `checkpoint` or `encoder`) and
    applied. Returns (what it did, what it deleted of an interrupted one)."""
    from rlm.inference.indexing import check_index_for
    from rlm.retriever.index import PassageIndex

    left = orphans_removed(index_dir)
    index = PassageIndex.load(index_dir, use_gpu=False)
    check_index_for(index, index_dir, base.ids, corpus_fingerprint=base.fingerprint)
    plan = plan_update(index_dir, index, base, add, delete)
    rows = row_encoder(index, index_dir, checkpoint, encoder, device, batch_size)
    return apply_update(index_dir, index, plan, rows), left


def update_buffer(
    folder, base: Corpus, add=None, delete=None, checkpoint=None, encoder=None, device=None, batch_size=64
) -> tuple[UpdateResult, list[Path]]:
    """`rlm corpus update --buffer`: the same for a training run's buffer B, its passages embedded by g0
    (`buffer_encoder`)."""
    left = buffer_orphans_removed(folder)
    target = open_buffer(folder, base)
    plan = plan_update(folder, target, base, add, delete)
    rows = buffer_encoder(target, checkpoint, encoder, device, batch_size)
    return apply_buffer_update(target, plan, rows), left


def apply_update(index_dir: str | Path, index, plan: UpdatePlan, encoder) -> UpdateResult:
    """Apply `plan` to `index` (loaded from `index_dir`, on the host, whole): its passages embedded by
    `encoder` (a `RowEncoder`) and added, the rows it replaces or deletes removed; saved as the next generation
    of the folder, its passages and rows kept in `updates/<n>/`."""
    index_dir, added = Path(index_dir), plan.added
    result, vectors, fp = _embedded(plan, encoder, index.edition, index.dim, "float16")
    store = f"{STORES}/{result.number:04d}"
    _write_store(index_dir / store, added, plan.add_path, plan.deletions, vectors)
    old_rows = exact_rows(index, index_dir)  # before the new rows join them
    started, first_row = time.perf_counter(), index.ntotal
    index.add_rows(vectors, list(added.ids) if added else [])
    index.remove_rows(plan.replaced + plan.deleted)
    if index.rescoring is not None:
        index.rescoring.rows = index.rescoring.rows.grown([index_dir / store / "rows.npy"], index.ids)
    result.seconds["index"] = time.perf_counter() - started
    result.checks, result.warnings = outgrown(index, vectors, first_row, old_rows)
    started = time.perf_counter()
    _commit(index, index_dir, result, store, encoder.fingerprint, first_row, fp)
    result.seconds["save"] = time.perf_counter() - started
    result.rows, result.live = index.ntotal, index.ntotal - len(index.removed)
    return result


def exact_rows(index, index_dir: Path):
    """The exact rows the index holds (a `PassageBuffer`: its buffer, grown by the updates' rows), where it
    knows them: the buffer it re-scores from, else the one it was built from if still there; else None."""
    if index.rescoring is not None:
        return index.rescoring.rows
    folder = index.built_from.get("rows_absolute")
    if not folder or not Path(folder).is_dir():
        return None
    from rlm.retriever.buffer import PassageBuffer

    return index._with_appended(PassageBuffer.load(folder), Path(index_dir))


def outgrown(index, vectors: np.ndarray, first_row: int, old_rows=None) -> tuple[dict, list[str]]:
    """The two checks of an update's new rows (`vectors`, from row `first_row`): their quantization error
    against the codebooks' training sample's, and the share of made questions on them whose passage the tuned
    search finds against the same share on old rows (`old_rows`: the exact rows before `first_row`, a
    `PassageBuffer`; None: not measured). Returns (what was measured, what the user should be told)."""
    from rlm.retriever.index import quantization_error

    checks, told = {}, []
    baseline = index.quantization.get("mean_squared_error")
    if len(vectors) and baseline:
        error = quantization_error(index._host_index(), vectors.astype(np.float32))
        if error is not None:
            checks["quantization_ratio"] = error / baseline
            if error > QUANTIZATION_LIMIT * baseline:
                told.append(
                    f"the new rows' quantization error is {error / baseline:.2f} x the codebooks' training sample's "
                    f"(limit {QUANTIZATION_LIMIT}): the codes fit the new rows worse; rebuild them from the current "
                    "rows with `rlm index --retrain DIR`"
                )
    scale = index.tuning.get("noise_scale")
    if len(vectors) and scale is not None and old_rows is not None:
        live = np.setdiff1d(np.arange(first_row), index.removed)
        old = _found_share(index, _sample_rows(old_rows, live), live, scale)
        new_rows = np.arange(first_row, first_row + len(vectors))
        new = _found_share(index, vectors.astype(np.float32), new_rows, scale)
        checks["made_questions_found"] = {"new_rows": new, "old_rows": old}
        if new < old - RECALL_MARGIN:
            told.append(
                f"made questions on the new rows find their passage {new:.3f} of the time, on old rows {old:.3f}, "
                f"at the tuned {index.tuning['parameter']}={index.tuning['value']}: the search settings no longer "
                "fit the rows; rebuild the codebooks and tune again with `rlm index --retrain DIR`"
            )
    return checks, told


def _sample_rows(rows, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float32 rows, their numbers) of up to `RECHECK_QUESTIONS` of the `live` rows of a `PassageBuffer`."""
    import torch

    picked = np.sort(np.random.default_rng(0).choice(live, min(RECHECK_QUESTIONS, len(live)), replace=False))
    return rows.rows(torch.from_numpy(picked)).float().numpy(), picked


def _found_share(index, rows, numbers: np.ndarray, scale: float, count: int = RECHECK_QUESTIONS) -> float:
    """The share of made questions whose source the index ranks in its top k: `rows` (float32 [n, D], row
    `numbers` of the index; or a (rows, numbers) pair) each moved by `scale` times the difference of two of
    them, as `tune` made its questions (`question_like_rows`), at the index's tuned k."""
    if isinstance(rows, tuple):
        rows, numbers = rows
    rng = np.random.default_rng(0)
    picked = np.sort(rng.choice(len(rows), min(count, len(rows)), replace=False))
    pairs = rng.integers(0, len(rows), (2, len(picked)))
    asked = rows[picked] + scale * (rows[pairs[0]] - rows[pairs[1]])
    asked /= np.linalg.norm(asked, axis=1, keepdims=True)
    _, found = index.search_rows(asked.astype(np.float32), int(index.tuning.get("k", 20)))
    return float((found == numbers[picked][:, None]).any(axis=1).mean())


def retrained(index_dir, train_sample: int | None = None):
    """The index in `index_dir` rebuilt from its current exact rows (`exact_rows`: its buffer and the rows its
    updates appended): new codebooks trained on a sample of the live rows, every row added again in its place,
    the removed ones removed, re-scoring, edition and quantization baseline kept or made anew, the search tuned
    again for the recall it was tuned for; saved as the folder's next generation and returned."""
    from rlm.retriever.index import PassageIndex
    from rlm.retriever.index_spec import IndexSpec

    index_dir = Path(index_dir)
    index = PassageIndex.load(index_dir, use_gpu=False)
    rows = exact_rows(index, index_dir)
    if rows is None:
        raise UserError(
            f"index {index_dir} knows no exact rows to retrain from (built from bare embeddings, over h(B), or its "
            "buffer moved): build it again with `rlm index --buffer`"
        )
    fresh = PassageIndex.from_buffer(rows, index.factory, use_gpu=False, train_sample=train_sample)
    fresh.ids, fresh.provenance, fresh.built_from = index.ids, index.provenance, index.built_from
    fresh.edition = index.edition
    fresh.remove_rows(index.removed)
    if index.rescoring is not None:
        fresh.rescore_from(rows, index.rescoring.k_factor)
    tuning = index.tuning
    spec = IndexSpec(
        factory=index.factory, target_recall=tuning.get("target_recall", IndexSpec().target_recall)
    )
    if tuning:
        fresh.apply_search(spec, rows, k=tuning.get("k"))
    else:
        fresh.set_search_params(index.search_params)
    generation = json.loads((index_dir / "index.json").read_text()).get("generation", 0) + 1
    fresh.save_generation(index_dir, generation)
    return fresh


@dataclass
class BufferEdition:
    """A training run's fixed buffer B and the edition its updates made (`rlm.data.buffer_edition`): what
    `plan_update` reads an update against, as it reads an index (`edition`, `removed`)."""

    folder: Path
    buffer: object  # the PassageBuffer of the base corpus's rows
    edition: dict
    removed: np.ndarray


def open_buffer(folder, base: Corpus) -> BufferEdition:
    """The buffer in `folder` (refused unless built for `base`) and its edition."""
    from rlm.data import buffer_edition
    from rlm.retriever.buffer import PassageBuffer

    folder = Path(folder)
    buffer = PassageBuffer.load(folder, corpus_fingerprint=base.fingerprint)
    record = buffer_edition.read_record(folder) or new_record(base)
    return BufferEdition(folder, buffer, record, buffer_edition.removed_rows(folder, record))


def buffer_encoder(target: BufferEdition, checkpoint=None, encoder=None, device=None, batch_size: int = 64):
    """g0, the passage tower the buffer was built by: the starting tower of the run that wrote `checkpoint` (from
    its config), or the encoder folder `encoder`; refused unless its fingerprint is the buffer's. Its rows come
    out as the buffer's (dtype, precision, max length)."""
    meta = target.buffer.meta
    recorded, how = meta["encoder_fingerprint"], (meta["precision"], meta["max_length"], meta["dtype"])
    where = f"buffer {target.folder}"
    if encoder is not None:
        return _from_folder(where, encoder, recorded, how, device, batch_size)
    from rlm.components import starting_passage_tower

    start = starting_passage_tower(checkpoint)
    if start.fingerprint() != recorded:
        raise UserError(
            f"{where} was built by passage tower {recorded}, not by the starting tower of {checkpoint} "
            f"({start.fingerprint()}): update it with the run (or `--encoder`) it was built for"
        )
    if device is not None:
        start.to(device)
    return RowEncoder(start, recorded, meta["precision"], batch_size=batch_size, dtype=meta["dtype"])


def apply_buffer_update(target: BufferEdition, plan: UpdatePlan, encoder: RowEncoder) -> UpdateResult:
    """Apply `plan` to a training run's buffer: its passages embedded by g0 (`encoder`, `buffer_encoder`) and
    kept with their rows in `updates/<n>/`, the rows they replace or delete listed as removed, and the edition
    committed (`rlm.data.buffer_edition.commit`). The buffer's own files are not touched."""
    from rlm.data import buffer_edition
    from rlm.retriever.buffer import _nonfinite_error, nonfinite_rows

    folder, added, record = target.folder, plan.added, target.edition
    dim, dtype = target.buffer.dim, target.buffer.meta["dtype"]
    result, vectors, fp = _embedded(plan, encoder, record, dim, dtype)
    bad = nonfinite_rows(vectors)
    if len(bad):
        raise _nonfinite_error(f"update of {folder}", bad, added.ids, "nothing was written")
    started = time.perf_counter()
    store = f"{buffer_edition.STORES}/{result.number:04d}"
    _write_store(folder / store, added, plan.add_path, plan.deletions, vectors)
    first_row = len(plan.edition)
    removed = np.union1d(target.removed, np.asarray(plan.replaced + plan.deleted, dtype=np.int64))
    record = {
        **record,
        "updates": [*record["updates"], update_entry(result, store, fp, encoder.fingerprint, first_row)],
    }
    record["fingerprint"] = result.fingerprint
    buffer_edition.commit(folder, record, removed)
    result.seconds["save"] = time.perf_counter() - started
    result.rows = first_row + len(vectors)
    result.live = result.rows - len(removed)
    return result


def buffer_orphans_removed(folder) -> list[Path]:
    """Delete what an update of a buffer killed before its commit left (`rlm.data.buffer_edition.orphans`)."""
    from rlm.data.buffer_edition import orphans

    return _deleted(orphans(folder))
