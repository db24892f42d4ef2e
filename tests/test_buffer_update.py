"""Issue 50 item 4: training takes a buffer that corpus updates grew (`rlm corpus update --buffer DIR`).

The passages an update adds are embedded by the starting passage tower g0 and join the fixed buffer B; a run
resumed over it selects them through h at once and never selects the rows of replaced or deleted passages.
The strongest check is an update that replaces every passage by itself: the new rows are B's rows bit for bit,
every old row is removed, and the resumed run must train exactly as the uninterrupted one did (same losses),
while reading only new rows. Then a new passage whose original is deleted takes its place in the selection.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_run import read_log, runs_beside, same_losses, train_args, train_here

from rlm.cli import main as rlm_main
from rlm.components import build_components
from rlm.config import load_config
from rlm.data.buffer_edition import EDITION_NAME, corpus_of_buffer
from rlm.data.corpus import load_corpus
from rlm.data.corpus_edition import CorpusEdition
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.search import corrected_topk, two_stage_corrected_topk
from rlm.training.strategies import make_strategy

STEPS = 6
MOVED = ["--allow-changed", "buffer.dir"]  # each resumed copy grows a buffer of its own


@pytest.fixture(scope="module")
def root(tiny_world, tmp_path_factory):
    return runs_beside(tiny_world, tmp_path_factory.mktemp("buffer_update"))


def own_buffer(root: Path, name: str) -> str:
    """A copy of the tiny world's buffer that this run may grow (the shared one is read-only)."""
    folder = root / f"buffer_{name}"
    if not folder.exists():
        shutil.copytree(root / "buffer", folder)
    return f"buffer.dir={folder}"


def write_passages(path: Path, passages) -> Path:
    with open(path, "w") as f:
        for p in passages:
            f.write(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n")
    return path


def update_buffer(buffer: str, corpus: Path, checkpoint: Path, *args: str) -> int:
    return rlm_main(
        [
            "corpus",
            "update",
            "--buffer",
            buffer,
            "--corpus",
            str(corpus),
            "--checkpoint",
            str(checkpoint),
            *args,
        ]
    )


# ---- the library: excluded rows are never selected -----------------------------------------------------------


def test_excluded_rows_are_never_selected_and_the_rest_rank_as_without_them():
    torch.manual_seed(0)
    rows, queries = torch.randn(300, 16), torch.randn(5, 16)
    excluded = torch.tensor([3, 17, 64, 65, 66, 200, 299])
    kept = torch.tensor([r for r in range(300) if r not in set(excluded.tolist())])
    corrector = torch.nn.Linear(16, 16)
    top = corrected_topk(queries, rows, corrector, 10, chunk_size=64, excluded=excluded)
    alone = corrected_topk(queries, rows[kept], corrector, 10, chunk_size=64)
    assert torch.equal(top.indices, kept[alone.indices])
    assert torch.equal(top.scores, alone.scores)
    two = two_stage_corrected_topk(queries, rows, corrector, 10, None, 40, excluded=excluded)
    assert not torch.isin(two.indices, excluded).any()
    drawn = corrected_topk(
        queries, rows, None, 4, num_random=250, generator=torch.Generator().manual_seed(0), excluded=excluded
    )
    assert not torch.isin(drawn.indices, excluded).any()  # uniform negatives are live rows too


# ---- the command -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(root):
    """An uninterrupted 6-step run over its own copy of the buffer (checkpoints at 2, 4, 6)."""
    assert train_here(train_args(root, "reference", own_buffer(root, "reference"), steps=STEPS)) == 0
    return read_log(root / "reference" / "log.jsonl")


def test_a_bad_update_of_a_buffer_names_file_and_line_and_writes_nothing(root, reference, tmp_path, capsys):
    buffer = root / "buffer_reference"
    corpus = root / "toy" / "corpus.jsonl"
    before = sorted(p.relative_to(buffer) for p in buffer.rglob("*"))
    unknown = tmp_path / "delete.txt"
    unknown.write_text("no-such-passage\n")
    assert update_buffer(str(buffer), corpus, root / "reference" / "final", "--delete", str(unknown)) == 2
    assert f"{unknown}:1: passage id 'no-such-passage' is not in the corpus" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    write_passages(other, list(load_corpus(corpus))[:5])
    assert update_buffer(str(buffer), other, root / "reference" / "final", "--delete", str(unknown)) == 2
    assert "built with corpus fingerprint" in capsys.readouterr().err
    assert sorted(p.relative_to(buffer) for p in buffer.rglob("*")) == before


def resumable_copy(root: Path, name: str, from_step: int) -> Path:
    """The reference run's folder copied to `name` as a kill after checkpoint `from_step` would leave it, with
    its own copy of the buffer (not yet updated)."""
    out = root / name
    shutil.copytree(root / "reference", out)
    shutil.rmtree(out / "final")
    for folder in (out / "checkpoints").glob("step_*"):
        if int(folder.name[5:]) > from_step:
            shutil.rmtree(folder)
    log = out / "log.jsonl"
    log.write_text("".join(f"{json.dumps(r)}\n" for s, r in sorted(read_log(log).items()) if s <= from_step))
    shutil.copytree(root / "buffer_reference", root / f"buffer_{name}")
    return out


def test_resume_over_a_buffer_whose_every_passage_an_update_replaced_trains_as_before(
    root, reference, capsys
):
    out = resumable_copy(root, "replaced", from_step=4)
    buffer = root / "buffer_replaced"
    corpus_file = root / "toy" / "corpus.jsonl"
    base = load_corpus(corpus_file)
    add = write_passages(out.parent / "every_passage.jsonl", base)
    # g0 embeds them as it built B: the same batches (one shard, sorted by length), so the same rows.
    assert (
        update_buffer(str(buffer), corpus_file, out / "checkpoints" / "step_0000004", "--add", str(add)) == 0
    )
    assert "120 replaced" in capsys.readouterr().out
    stored = np.load(buffer / "updates" / "0001" / "rows.npy")
    assert np.array_equal(stored, np.load(buffer / "shard_00000.npy"))

    edition = corpus_of_buffer(buffer, base)
    assert isinstance(edition, CorpusEdition) and len(edition) == 240
    assert edition.removed.tolist() == list(range(120))  # every old row, none of the new
    # What the resumed run selects from: new rows only, each ranked where its original was.
    cfg = load_config(None, [a for a in train_args(root, "replaced", f"buffer.dir={buffer}") if a != "--set"])
    parts = build_components(cfg)
    questions = [ex.question for ex in parts.train_examples[:8]]
    queries = parts.retriever.query_tower.encode(questions)
    h = torch.nn.Linear(parts.buffer.dim, parts.buffer.dim)
    grown = make_strategy(cfg.strategy, parts.buffer, STEPS).select(queries, h).indices
    alone = make_strategy(cfg.strategy, PassageBuffer.load(buffer), STEPS).select(queries, h).indices
    assert len(parts.buffer) == 240 and torch.equal(grown, alone + 120)
    argv = [*train_args(root, "replaced", f"buffer.dir={buffer}", steps=STEPS), "--resume", *MOVED]
    assert train_here(argv) == 0
    printed = capsys.readouterr().out
    assert "the corpus changed since step_0000004: 1 corpus update(s)" in printed
    assert "120 -> 240 rows (120 removed in all)" in printed
    same_losses(read_log(out / "log.jsonl"), reference)


def test_a_new_passage_is_selected_through_h_in_place_of_the_one_it_replaces(root, reference, capsys):
    out = resumable_copy(root, "grown", from_step=4)
    buffer = root / "buffer_grown"
    corpus_file = root / "toy" / "corpus.jsonl"
    base = load_corpus(corpus_file)
    cfg = load_config(None, [a for a in train_args(root, "grown", f"buffer.dir={buffer}") if a != "--set"])
    before = build_components(cfg)
    corrector = torch.nn.Linear(before.buffer.dim, before.buffer.dim)  # any h: the rows move alike
    question = before.train_examples[0]
    queries = before.retriever.query_tower.encode([question.question])
    strategy = make_strategy(cfg.strategy, before.buffer, STEPS)
    first = strategy.select(queries, corrector).indices[0]
    chosen = base[int(first[0])]
    # The best passage moves to a new id (its text kept), and the original is deleted.
    moved = write_passages(out.parent / "moved.jsonl", [replace(chosen, id=f"{chosen.id}-moved")])
    deleted = out.parent / "deleted.txt"
    deleted.write_text(f"{chosen.id}\n")
    args = ["--add", str(moved), "--delete", str(deleted)]
    assert update_buffer(str(buffer), corpus_file, out / "checkpoints" / "step_0000004", *args) == 0
    assert "1 passages added, 0 replaced, 1 deleted" in capsys.readouterr().out

    after = build_components(cfg)
    assert len(after.buffer) == 121 and after.buffer.removed.tolist() == [int(first[0])]
    strategy = make_strategy(cfg.strategy, after.buffer, STEPS)
    second = strategy.select(queries, corrector).indices[0]
    assert int(second[0]) == 120 and after.corpus[120].id == f"{chosen.id}-moved"
    assert int(first[0]) not in second.tolist()
    assert second[1:].tolist() == first[1 : len(second)].tolist()  # the others as they were
    argv = [*train_args(root, "grown", f"buffer.dir={buffer}", steps=STEPS), "--resume", *MOVED]
    assert train_here(argv) == 0
    assert "120 -> 121 rows (1 removed in all)" in capsys.readouterr().out


def test_resume_over_a_buffer_whose_updates_were_undone_is_refused(root, reference, capsys):
    out = resumable_copy(root, "undone", from_step=4)
    buffer = root / "buffer_undone"
    corpus_file = root / "toy" / "corpus.jsonl"
    deleted = out.parent / "undone_delete.txt"
    deleted.write_text(f"{load_corpus(corpus_file)[5].id}\n")
    assert (
        update_buffer(
            str(buffer), corpus_file, out / "checkpoints" / "step_0000004", "--delete", str(deleted)
        )
        == 0
    )
    argv = [*train_args(root, "undone", f"buffer.dir={buffer}", steps=STEPS), "--resume", *MOVED]
    assert train_here(argv) == 0  # steps 5 and 6 over the edition; step 6's checkpoint records it
    shutil.rmtree(out / "final")
    (buffer / EDITION_NAME).unlink()  # the update undone by hand
    capsys.readouterr()
    assert train_here(argv) == 2
    err = capsys.readouterr().err
    assert "was trained over corpus edition edition:sha256:" in err
    assert "which does not descend from it" in err


def test_a_refreshing_strategy_resumed_over_a_grown_buffer_re_embeds_at_once(root, capsys):
    """Exhaustive re-embeds every R steps; its refreshed rows at the checkpoint lack the new passage (and B's g0
    row of it is not in their space), so the resumed run re-embeds the grown corpus before its first step."""
    extra = ("strategy.name=exhaustive", "strategy.refresh_every=3")
    args = train_args(root, "exhaustive", own_buffer(root, "exhaustive_ref"), *extra, steps=STEPS)
    assert train_here(args) == 0
    reference = read_log(root / "exhaustive" / "log.jsonl")
    shutil.copytree(root / "exhaustive", root / "reference_exhaustive")
    out = root / "exhaustive"
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step_0000006")
    buffer = root / "buffer_exhaustive_ref"
    corpus_file = root / "toy" / "corpus.jsonl"
    first = load_corpus(corpus_file)[0]
    add = write_passages(out.parent / "one_more.jsonl", [replace(first, id="one-more")])
    assert (
        update_buffer(str(buffer), corpus_file, out / "checkpoints" / "step_0000004", "--add", str(add)) == 0
    )
    assert train_here([*args, "--resume"]) == 0
    resumed = read_log(out / "log.jsonl")
    assert reference[5]["reembedded"] == reference[4]["reembedded"]  # no refresh due at step 5 ...
    assert resumed[5]["reembedded"] == reference[5]["reembedded"] + 121  # ... but the corpus grew


@pytest.mark.slow
def test_two_processes_resumed_over_a_replaced_corpus_train_as_before_with_the_rows_sharded(root, capsys):
    """`accelerate launch` on two processes, as the README launches it: the grown buffer's rows are sharded, so
    one process holds only removed rows (every passage was replaced) and the other only new ones; the resumed
    run must train as the uninterrupted one did."""
    import subprocess

    from local_port import launch_env, two_processes

    args = train_args(root, "two", own_buffer(root, "two"), steps=STEPS)
    launch = lambda *more: subprocess.run(  # noqa: E731
        two_processes("-m", "rlm.train", *args, *more), capture_output=True, text=True, env=launch_env()
    )
    done = launch()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "buffer sharded across 2 processes" in done.stdout
    reference = read_log(root / "two" / "log.jsonl")
    out = root / "two"
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step_0000006")
    log = out / "log.jsonl"
    log.write_text("".join(f"{json.dumps(r)}\n" for s, r in sorted(reference.items()) if s <= 4))
    corpus_file = root / "toy" / "corpus.jsonl"
    add = write_passages(out.parent / "two_every_passage.jsonl", load_corpus(corpus_file))
    buffer = str(root / "buffer_two")
    assert update_buffer(buffer, corpus_file, out / "checkpoints" / "step_0000004", "--add", str(add)) == 0
    done = launch("--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "120 -> 240 rows (120 removed in all)" in done.stdout
    same_losses(read_log(log), reference)


@pytest.mark.slow
def test_a_buffer_update_killed_at_any_moment_leaves_the_edition_as_it_was_or_done(root, reference):
    """SIGKILL at moments through a real `rlm corpus update --buffer` (a child process, as a cluster kills one):
    after each kill the buffer opens with 0 or 1 updates, never half of one; the rerun applies it once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    corpus_file = root / "toy" / "corpus.jsonl"
    base = load_corpus(corpus_file)
    add = write_passages(root / "killed_every_passage.jsonl", base)
    argv = [sys.executable, "-m", "rlm", "corpus", "update", "--corpus", str(corpus_file), "--add", str(add)]
    argv += ["--checkpoint", str(root / "reference" / "final")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    timed = root / "buffer_timed"
    shutil.copytree(root / "buffer", timed)
    start = time.monotonic()
    assert subprocess.run([*argv, "--buffer", str(timed)], env=env, capture_output=True).returncode == 0
    full = time.monotonic() - start
    buffer = root / "buffer_killed"
    shutil.copytree(root / "buffer", buffer)
    interrupted = 0
    for share in (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0):
        child = subprocess.Popen(
            [*argv, "--buffer", str(buffer)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(full * share)
        child.send_signal(signal.SIGKILL)
        child.wait()
        edition = corpus_of_buffer(buffer, base)  # as it was, or done: never half
        applied = isinstance(edition, CorpusEdition)
        assert len(edition) == 120 + 120 * applied and len(getattr(edition, "removed", [])) == 120 * applied
        if applied:
            break
        interrupted += 1
    assert interrupted  # at least one kill landed before the commit
    if not applied:  # the rerun cleans what the killed ones left and applies it once
        assert subprocess.run([*argv, "--buffer", str(buffer)], env=env, capture_output=True).returncode == 0
    from rlm.data.buffer_edition import orphans, read_record

    assert len(read_record(buffer)["updates"]) == 1 and orphans(buffer) == []
    assert np.array_equal(
        np.load(buffer / "updates" / "0001" / "rows.npy"), np.load(timed / "updates" / "0001" / "rows.npy")
    )


def test_an_index_over_h_of_an_updated_buffer_says_it_answers_from_the_base_corpus(root, reference, tmp_path):
    from rlm.inference.corrected_index import corrected_index
    from rlm.retriever.index_spec import IndexSpec

    buffer = root / "buffer_for_index"
    shutil.copytree(root / "buffer", buffer)
    corpus_file = root / "toy" / "corpus.jsonl"
    base = load_corpus(corpus_file)
    deleted = tmp_path / "delete.txt"
    deleted.write_text(f"{base[7].id}\n")
    assert (
        update_buffer(str(buffer), corpus_file, root / "reference" / "final", "--delete", str(deleted)) == 0
    )
    with pytest.warns(UserWarning, match="holds 1 corpus update"):
        built = corrected_index(root / "reference" / "final", base, buffer, IndexSpec(factory="Flat"))
    assert built.index.ntotal == 120


def test_live_random_rows_and_sorted_membership_when_most_rows_are_excluded():
    from rlm.retriever.search import _live_random_rows, in_sorted

    excluded = torch.tensor(sorted(set(range(1000)) - set(range(3, 1000, 10))))  # 900 of 1000 rows excluded
    drawn = _live_random_rows(1000, 60, torch.Generator().manual_seed(0), excluded)
    assert len(drawn) == 60 == len(drawn.unique()) and not torch.isin(drawn, excluded).any()
    values = torch.tensor([-1, 0, 3, 5, 13, 999, 2000])
    assert torch.equal(in_sorted(values, excluded), torch.isin(values, excluded))
    assert not in_sorted(values, torch.zeros(0, dtype=torch.long)).any()


def test_validation_never_retrieves_a_passage_an_update_deleted(root, reference, tmp_path):
    from rlm.data.corpus_edition import CorpusEdition
    from rlm.inference.checkpoint import load_checkpoint
    from rlm.retriever.distributed import Processes
    from rlm.training.validation import sharded_retrieve

    base = load_corpus(root / "toy" / "corpus.jsonl")
    retriever, _, _ = load_checkpoint(root / "reference" / "final", need_reader=False, device="cpu")
    questions = [ex.question for ex in build_components(reference_config(root)).train_examples[:6]]
    before = sharded_retrieve(retriever, base, questions, 5, Processes())
    gone = sorted({base.index_of(ids[0]) for ids in before.ids})  # every question's best passage
    edition = CorpusEdition(base, [], np.asarray(gone), "edition:test")
    after = sharded_retrieve(retriever, edition, questions, 5, Processes())
    assert not {base[r].id for r in gone} & {pid for ids in after.ids for pid in ids}
    assert all(len(ids) == 5 for ids in after.ids)


def test_processes_that_read_different_editions_refuse_to_start(root):
    from types import SimpleNamespace

    from rlm.data.buffer_edition import check_one_edition
    from rlm.errors import UserError

    base = load_corpus(root / "toy" / "corpus.jsonl")
    edition = CorpusEdition(base, [], np.zeros(0, np.int64), "edition:e")
    every = SimpleNamespace(gather_object=lambda mine: mine * 2)  # two processes that read the same
    check_one_edition(every, edition, "B")
    check_one_edition(every, base, "B")  # no update read anywhere
    with pytest.raises(UserError, match="a corpus update was committed while the run started"):
        check_one_edition(SimpleNamespace(gather_object=lambda mine: [*mine, None]), edition, "B")


def reference_config(root: Path):
    return load_config(
        None, [a for a in train_args(root, "reference", own_buffer(root, "reference")) if a != "--set"]
    )
