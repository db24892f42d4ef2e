"""The quickstart's last stage, a living corpus: the toy world's next edition taken by the trained run's index
without retraining, and what the checkpoint answers before and after it.

`prepare_living_corpus` writes the world's next edition (`rlm.data.toy_world_edition`: new people, moved and
renamed organisations, people with a new employer, people removed, and a question about each change) and the
index `rlm embed --encoder <checkpoint>/retriever` then `rlm index --buffer` would build of the base corpus (the
demo serves that folder and follows its updates). `measure_living_corpus` answers the edition's questions and
the dev questions no change touches with the checkpoint's answer policy deciding what is abstained (the one the
demo applies), applies the edition as `rlm corpus update` does (its library calls, `rlm.inference.corpus_update`),
answers them again from the edition the index then serves, and counts the passages the update deleted or
replaced among those shown. Everything lands in `<run>/edition/`: `update/` (the edition's files),
`embeddings/` (the buffer), `index/` (the index and its update), `before/` and `after/` (predictions.jsonl and
metrics.json as `rlm evaluate` writes them).

A changed fact answered with its old value may be the reader's memory overriding the passage it reads
(knowledge conflicts, Longpre et al. 2021), or a question the run never learned to answer. So each changed-fact
question is counted by whether training asked about its subject and whether its question type is one the run
trained on, with whether the new passage was among those read (`changed_facts`).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlm.data.toy_world_edition import CHANGES, EditionPaths, edition_paths
from rlm.errors import UserError

PER_CHANGE = (10, 5, 2, 1)  # changes of each kind: the first the world's dev split is large enough for
EDITION_SEED = 1
SHOWN_K = 20  # passages retrieved per question: the most the demo shows, the k of gold recall@20
CHANGED_FACTS = ("moved", "changed_occupation", "changed_employer", "renamed")
LABELS = {
    "new": "new people",
    "moved": "moved organisations (their city)",
    "changed_occupation": "changed occupation",
    "changed_employer": "changed employer",
    "renamed": "renamed organisations",
    "removed": "removed people (right: the deleted answer)",
    "unchanged": "dev questions no change touches",
}


@dataclass(frozen=True)
class LivingCorpus:
    """The stage's folder in the run folder, the world and checkpoint it is about, and what preparing took."""

    root: Path
    world: Path  # the toy world the edition updates
    checkpoint: Path
    per_change: int
    seconds: dict = field(default_factory=dict)

    @property
    def update(self) -> EditionPaths:
        return edition_paths(self.root / "update")

    @property
    def index(self) -> Path:
        return self.root / "index"

    @property
    def embeddings(self) -> Path:
        return self.root / "embeddings"


def prepare_living_corpus(run_dir, world, checkpoint, device=None) -> LivingCorpus:
    """The next edition of the toy world in `world` written into `<run_dir>/edition/update` (`PER_CHANGE`
    changes of each kind, fewer in a world too small for them), and the base corpus embedded by `checkpoint`'s
    passage tower and indexed into `<run_dir>/edition/index`; an earlier run's `edition/` is replaced whole
    (everything in it is made here). A world whose dev split cannot take a single change is refused."""
    world, root = Path(world), Path(run_dir) / "edition"
    if not (world / "world.json").is_file():
        raise UserError(
            f"the run's corpus is not a toy world's ({world} has no world.json): no edition of it"
        )
    if root.exists():
        shutil.rmtree(root)
    started = time.perf_counter()
    per_change = _write_edition(world, root / "update")
    seconds = {"write_edition": time.perf_counter() - started}
    living = LivingCorpus(root, world, Path(checkpoint), per_change, seconds)
    started = time.perf_counter()
    _index_base_corpus(living, device)
    seconds["index_base_corpus"] = time.perf_counter() - started
    return living


def _write_edition(world: Path, out: Path) -> int:
    """`rlm toy-world --next-edition-of world --out out --per-change N` for the first N of `PER_CHANGE` the
    world's dev split has entities enough for; returns N."""
    from rlm.data.toy_world_edition import build_toy_world_edition

    for per_change in PER_CHANGE:
        try:
            build_toy_world_edition(world, out, per_change=per_change, seed=EDITION_SEED)
        except UserError:  # its dev split is too small for so many
            continue
        return per_change
    raise UserError(
        "no edition of this world: its dev split is too small even for one change of each kind; a larger "
        "world (data.toy_world.num_passages) has room for one"
    )


def _index_base_corpus(living: LivingCorpus, device) -> None:
    """What `rlm embed --encoder <checkpoint>/retriever` then `rlm index --buffer` build at their defaults: the
    corpus in float16 shards by the trained passage tower, indexed from them (`IndexSpec()`: exact here)."""
    from rlm.data.corpus import load_corpus
    from rlm.inference.checkpoint import load_checkpoint
    from rlm.inference.indexing import index_corpus

    retriever, _, _ = load_checkpoint(living.checkpoint, need_reader=False, device=device)
    corpus = load_corpus(living.world / "corpus.jsonl")
    index = index_corpus(retriever.passage_tower.eval(), corpus, living.embeddings, use_gpu=False)
    index.save(living.index)


def measure_living_corpus(living: LivingCorpus, num_passages: int, device=None) -> dict:
    """The edition's questions and the dev questions no change touches answered before the update and after
    it (the reader reading the top `num_passages`, the checkpoint's answer policy deciding what is abstained),
    the update applied in between. Returns metrics.json's `edition`: counts per change kind (`kinds`), the
    changed facts split by what training saw (`changed_facts`), the passages shown that the update retired
    (`retired_shown`), the update, a question about a new person to try (`example`) and the seconds."""
    from rlm.data.corpus import load_corpus
    from rlm.data.qa import read_qa_jsonl
    from rlm.inference.answer_policy import AnswerPolicy
    from rlm.inference.checkpoint import load_checkpoint

    began = started = time.perf_counter()
    retriever, reader, _ = load_checkpoint(living.checkpoint, device=device)
    retriever.eval()
    reader.eval()
    policy = AnswerPolicy.load(living.checkpoint)
    paths = living.update
    asked = read_qa_jsonl(paths.dev) + read_qa_jsonl(paths.unchanged_dev)
    base = load_corpus(living.world / "corpus.jsonl")
    models = (retriever, reader, policy, num_passages)
    seconds = {"load": time.perf_counter() - started}

    started = time.perf_counter()
    before = _answered(models, asked, _served(living.index, retriever, base), living.root / "before")
    seconds["answer_before"] = time.perf_counter() - started
    update = _apply_update(living, base, device)
    seconds["update"] = update["seconds"]["total"]
    started = time.perf_counter()
    served = _served(living.index, retriever, base)
    after = _answered(models, asked, served, living.root / "after")
    seconds["answer_after"] = time.perf_counter() - started
    trained = _trained_on(living.world)
    rows = [_row(q, b, a, trained, num_passages) for q, b, a in zip(asked, before.records, after.records)]
    retired = _retired_shown(served, retriever, asked, base, paths)
    seconds = {**living.seconds, **seconds}
    stage = sum(living.seconds.values()) + time.perf_counter() - began
    return {
        "edition": str(paths.root),
        "index": str(living.index),
        "per_change": living.per_change,
        "seed": EDITION_SEED,
        "answer_policy": policy is not None,
        "reader_passages": num_passages,
        "kinds": _by_kind(rows),
        "changed_facts": _changed_facts(rows),
        "question_types": _question_types(asked, trained[1]),
        "retired_shown": retired,
        "update": update,
        "example": _example(asked, before.records, after.records),
        "seconds": {**{key: round(value, 2) for key, value in seconds.items()}, "stage": round(stage, 2)},
    }


def _served(index_dir: Path, retriever, base):
    """(the index in `index_dir`, checked against the checkpoint's tower and the base corpus; the corpus it
    serves: the base, or its edition after an update), opened as `rlm evaluate --index` and the demo open it."""
    from rlm.inference.indexing import prebuilt_index, served_corpus

    index = prebuilt_index(index_dir, retriever, base, use_gpu=False, search_params=None)
    return index, served_corpus(index, base, index_dir)


def _answered(models, asked, served, out_dir: Path):
    """`rlm evaluate --index`: the top `SHOWN_K` retrieved, the reader's K of them read, the policy's verdicts."""
    from rlm.inference.evaluation import run_evaluation

    retriever, reader, policy, num_passages = models
    index, corpus = served
    return run_evaluation(
        asked,
        corpus=corpus,
        retriever=retriever,
        reader=reader,
        index=index,
        k=SHOWN_K,
        num_passages=num_passages,
        policy=policy,
        out_dir=out_dir,
    )


def _apply_update(living: LivingCorpus, base, device) -> dict:
    """`rlm corpus update --index <index> --corpus <base> --add add.jsonl --delete delete.txt --checkpoint C`,
    through the library calls the command makes; what it did and the seconds it took."""
    from rlm.inference.corpus_update import update_index

    started = time.perf_counter()
    paths = living.update
    result, _ = update_index(
        living.index, base, paths.add, paths.delete, checkpoint=living.checkpoint, device=device
    )
    total = time.perf_counter() - started
    return {
        "added": result.added,
        "replaced": result.replaced,
        "deleted": result.deleted,
        "searchable": result.live,
        "corpus_edition": result.fingerprint,
        "warnings": result.warnings,
        "seconds": {
            **{key: round(value, 2) for key, value in result.seconds.items()},
            "total": round(total, 2),
        },
    }


def _retired_shown(served, retriever, asked, base, paths: EditionPaths) -> dict:
    """How many of the top `SHOWN_K` passages of each question after the update, read by index row as the
    demo reads them, are a row the update removed or an (id, text) of the base corpus it deleted or replaced."""
    from rlm.inference.retrieval import encode_questions

    index, corpus = served
    deleted = {line.strip() for line in paths.delete.read_text().splitlines() if line.strip()}
    replaced = {json.loads(line)["id"] for line in paths.add.read_text().splitlines() if line.strip()}
    gone = sorted(deleted | (replaced & set(base.ids)))
    retired = {(p.id, p.text) for p in (base[base.index_of(pid)] for pid in gone)}
    queries = encode_questions(retriever.query_tower, [q.question for q in asked])
    _, rows = index.search_rows(queries, SHOWN_K)
    shown = [int(r) for r in rows.flat if r >= 0]
    stale = sum(corpus.is_removed(r) or (corpus[r].id, corpus[r].text) in retired for r in shown)
    return {"shown": len(shown), "retired": int(stale), "passages_retired": len(retired)}


def _trained_on(world: Path) -> tuple[set[str], set[str]]:
    """(the subjects of the world's training questions, their question types)."""
    from rlm.data.qa import read_qa_jsonl

    train = read_qa_jsonl(world / "train.jsonl")
    return {q.meta.get("subject") for q in train}, {q.meta.get("type") for q in train}


def _question_types(asked, trained: set[str]) -> dict:
    """The question types the run trained, and those the edition asks that it did not."""
    untrained = {q.meta.get("type") for q in asked} - trained
    return {"trained": sorted(trained), "asked_untrained": sorted(untrained)}


def _row(question, before: dict, after: dict, trained, num_passages: int) -> dict:
    """One question before and after the update: its change, what training saw of it, whether its passage was
    among the `num_passages` read after, and each time abstained, right or wrong."""
    subjects, types = trained
    read = after.get("retrieved_ids", [])[:num_passages]
    return {
        "change": question.meta.get("change", "unchanged"),
        "subject_trained": question.meta.get("subject") in subjects,
        "type_trained": question.meta.get("type") in types,
        "passage_read": bool(set(question.gold_passage_ids) & set(read)),
        "before": _outcome(before),
        "after": _outcome(after),
    }


def _outcome(record: dict) -> str:
    if record["abstained"]:
        return "abstained"
    return "right" if record["exact_match"] else "wrong"


def _counts(rows: list[dict]) -> dict:
    return {
        "questions": len(rows),
        "abstained_before": sum(r["before"] == "abstained" for r in rows),
        "right_before": sum(r["before"] == "right" for r in rows),
        "abstained_after": sum(r["after"] == "abstained" for r in rows),
        "right_after": sum(r["after"] == "right" for r in rows),
        "passage_read_after": sum(r["passage_read"] for r in rows),
    }


def _by_kind(rows: list[dict]) -> dict:
    kinds = [change for change in CHANGES if any(r["change"] == change for r in rows)]
    return {kind: _counts([r for r in rows if r["change"] == kind]) for kind in [*kinds, "unchanged"]}


def _changed_facts(rows: list[dict]) -> list[dict]:
    """The changed-fact questions in four groups: whether training asked about their subject, whether it
    trained their question type (each group listed, empty ones too)."""
    changed = [r for r in rows if r["change"] in CHANGED_FACTS]
    return [
        {
            "subject_in_training": subject,
            "type_trained": qtype,
            **_counts([r for r in changed if (r["subject_trained"], r["type_trained"]) == (subject, qtype)]),
        }
        for subject in (True, False)
        for qtype in (True, False)
    ]


def _example(asked, before: list[dict], after: list[dict]) -> dict | None:
    """A question about a new person for the user to try: one answered right after the update if any."""
    new = [(q, b, a) for q, b, a in zip(asked, before, after) if q.meta.get("change") == "new"]
    if not new:
        return None
    question, was, now = next(((q, b, a) for q, b, a in new if _outcome(a) == "right"), new[0])
    return {
        "question": question.question,
        "answer": question.answers[0],
        "before": _outcome(was),
        "after": _outcome(now),
        "prediction_after": now["prediction"],
    }


def format_edition(edition: dict) -> str:
    """The stage's tables: per change kind, then the changed facts by what training saw; and the invariant."""
    update, retired = edition["update"], edition["retired_shown"]
    seconds = edition["seconds"]
    abstained = (
        "the checkpoint's answer policy (the demo's) declined to answer"
        if edition["answer_policy"]
        else "never (the checkpoint has no answer policy)"
    )
    lines = [
        f"the toy world's next edition ({edition['per_change']} changes of each kind): {update['added']} passages "
        f"added, {update['replaced']} replaced, {update['deleted']} deleted by one corpus update in "
        f"{update['seconds']['total']:.2f} s (embedding {update['seconds']['embed']:.2f} s), nothing retrained.",
        f"Abstained: {abstained}; right: answered with the edition's answer; passage read: the question's "
        f"passage among the {edition['reader_passages']} the reader read after the update.",
        "",
        "| change | questions | abstained before | right before | abstained after | right after | passage read |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, c in edition["kinds"].items():
        read = "-" if kind == "removed" else c["passage_read_after"]
        lines.append(
            f"| {LABELS.get(kind, kind)} | {c['questions']} | {c['abstained_before']} | {c['right_before']} "
            f"| {c['abstained_after']} | {c['right_after']} | {read} |"
        )
    lines += ["", *_changed_fact_lines(edition["changed_facts"])]
    types = edition["question_types"]
    if types["asked_untrained"]:
        lines.append("")
        lines.append(
            f"the run trained on {', '.join(types['trained'])} questions; the edition also asks "
            f"{', '.join(types['asked_untrained'])} questions, which neither its retriever nor its reader trained on"
        )
    lines.append("")
    lines.append(
        f"passages the update deleted or replaced among the top {SHOWN_K} shown after it: {retired['retired']} "
        f"(of {retired['shown']:,} shown; {retired['passages_retired']} passages retired)"
    )
    lines.append(
        f"stage: {seconds['stage']:.1f} s (the edition written {seconds['write_edition']:.2f} s, the base corpus "
        f"embedded and indexed {seconds['index_base_corpus']:.1f} s, answering before {seconds['answer_before']:.1f}"
        f" s, the update {seconds['update']:.2f} s, answering after {seconds['answer_after']:.1f} s)"
    )
    return "\n".join(lines)


def _changed_fact_lines(groups: list[dict]) -> list[str]:
    lines = [
        "changed facts (moved, changed occupation, changed employer, renamed) by what the run trained on:",
        "",
        "| subject asked about in training | question type trained | questions | new passage read | right after |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for g in groups:
        lines.append(
            f"| {'yes' if g['subject_in_training'] else 'no'} | {'yes' if g['type_trained'] else 'no'} "
            f"| {g['questions']} | {g['passage_read_after']} | {g['right_after']} |"
        )
    return lines
