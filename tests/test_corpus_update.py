"""`rlm corpus update`: a trained system's corpus changes in place. Only the added and changed passages are
embedded; the index then answers like one rebuilt for the edited corpus; deleted and replaced passages are
never returned; the edition is a chain of fingerprints that `rlm evaluate --index` / `rlm demo --index` accept
for exactly this base corpus and these updates; bad input is one line naming the file and what to do, and
changes nothing; a killed update leaves the index as it was, or done, never half-applied."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rlm.cli import main
from rlm.data.corpus import load_corpus
from rlm.errors import UnknownPassageError
from rlm.inference.indexing import load_index_for, served_corpus
from rlm.retriever.buffer import embed_passages
from rlm.retriever.encoder import SentenceEncoder
from rlm.retriever.index import PassageIndex

ROOT = Path(__file__).resolve().parents[1]


def corpus_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def world(tiny_world, tmp_path):
    """The tiny world's corpus, encoder and buffer, an update of it (3 new passages, 2 replaced, 3 deleted) and
    a folder for its index."""
    base = tiny_world / "toy" / "corpus.jsonl"
    rows = corpus_rows(base)
    new = [
        {
            "id": f"new{i}",
            "title": f"Quillon Avesta {i}",
            "text": f"Quillon Avesta {i} keeps bees in Morvale.",
        }
        for i in range(3)
    ]
    changed = [{**r, "text": r["text"] + " It moved to Parrin last year."} for r in rows[:2]]
    add = write_rows(tmp_path / "add.jsonl", new + changed)
    delete = tmp_path / "delete.txt"
    delete.write_text("".join(r["id"] + "\n" for r in rows[10:13]))
    return {
        "root": tiny_world,
        "corpus": base,
        "encoder": tiny_world / "tiny_retriever",
        "buffer": tiny_world / "buffer",
        "add": add,
        "delete": delete,
        "deleted": [r["id"] for r in rows[10:13]],
        "changed": {r["id"]: r["text"] for r in changed},
        "new": [r["id"] for r in new],
        "tmp": tmp_path,
    }


def build_index(world, out: Path, *options: str) -> Path:
    assert main(["index", "--buffer", str(world["buffer"]), "--out", str(out), "--cpu", *options]) == 0
    return out


def update(world, index: Path, *options: str) -> int:
    argv = ["corpus", "update", "--index", str(index), "--corpus", str(world["corpus"])]
    argv += ["--add", str(world["add"]), "--delete", str(world["delete"]), "--encoder", str(world["encoder"])]
    return main([*argv, *options])


def tower(world) -> SentenceEncoder:
    meta = json.loads((world["buffer"] / "meta.json").read_text())
    return SentenceEncoder.from_pretrained(str(world["encoder"]), max_length=meta["max_length"])


def opened(world, index_dir: Path):
    base = load_corpus(world["corpus"])
    index = load_index_for(index_dir, base.ids, use_gpu=False, corpus_fingerprint=base.fingerprint)
    return index, served_corpus(index, base, index_dir)


def test_an_updated_index_answers_like_one_rebuilt_for_the_edited_corpus(world, capsys):
    index_dir = build_index(world, world["tmp"] / "index", "--factory", "Flat")
    assert update(world, index_dir) == 0
    assert (
        "3 passages added, 2 replaced, 3 deleted; 120 passages searchable (125 rows)"
        in capsys.readouterr().out
    )
    index, edition = opened(world, index_dir)
    assert len(edition) == 125 and edition.fingerprint.startswith("edition:")
    for pid, text in world["changed"].items():
        assert edition[edition.index_of(pid)].text == text
    for pid in world["deleted"]:
        with pytest.raises(UnknownPassageError, match="deleted by a corpus update"):
            edition.index_of(pid)
    # The same corpus written out and indexed from scratch: the same passages at the same scores.
    live = [edition[i] for i in range(len(edition)) if not edition.is_removed(i)]
    rebuilt_file = write_rows(
        world["tmp"] / "edited.jsonl", [{"id": p.id, "title": p.title, "text": p.text} for p in live]
    )
    encoder = tower(world)
    texts = load_corpus(rebuilt_file).retrieval_texts()
    vectors = embed_passages(encoder, texts, dtype="float16").astype(np.float32)
    rebuilt = PassageIndex.build(vectors, [p.id for p in live], "Flat", use_gpu=False)
    queries = embed_passages(encoder, texts, dtype="float32")
    scores, ids = index.search(queries, 10)
    want_scores, want_ids = rebuilt.search(queries, 10)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)
    assert [set(a) for a in ids] == [set(b) for b in want_ids]
    assert not {pid for row in ids for pid in row} & set(world["deleted"])


def test_an_ivf_index_that_re_scores_returns_no_removed_row_before_or_after_it_is_reloaded(world):
    index_dir = build_index(world, world["tmp"] / "ivf", "--factory", "IVF2,SQ8", "--rescore", "2")
    assert update(world, index_dir) == 0
    index, edition = opened(world, index_dir)
    assert index.index.ntotal == 120  # the IVF lists lost the 5 removed rows: only 120 of 125 rows are coded
    encoder = tower(world)
    queries = embed_passages(encoder, edition.retrieval_texts(), dtype="float32")
    for loaded in (index, PassageIndex.load(index_dir, use_gpu=False)):
        _, rows = loaded.search_rows(queries, 125)
        assert not np.isin(rows, loaded.removed).any() and (rows >= 0).sum(axis=1).min() == 120
        _, top = loaded.search_rows(queries[120:123], 1)  # each new passage's own text finds it first
        assert top[:, 0].tolist() == [120, 121, 122]


def test_a_second_update_chains_and_deletes_what_the_first_added(world, capsys):
    index_dir = build_index(world, world["tmp"] / "index", "--factory", "Flat")
    assert update(world, index_dir) == 0
    first = json.loads((index_dir / "index.json").read_text())["edition"]["fingerprint"]
    world["add"] = write_rows(
        world["tmp"] / "add2.jsonl", [{"id": "new9", "title": "Vel", "text": "Vel sings."}]
    )
    world["delete"].write_text("new0\n")
    assert update(world, index_dir) == 0
    index, edition = opened(world, index_dir)
    assert edition.fingerprint != first and len(index.edition["updates"]) == 2
    with pytest.raises(UnknownPassageError):
        edition.index_of("new0")
    assert edition[edition.index_of("new9")].text == "Vel sings."
    assert sorted(p.name for p in index_dir.glob("index*.faiss")) == ["index.0001.faiss", "index.0002.faiss"]


@pytest.mark.parametrize(
    "case",
    [
        "malformed line",
        "unknown id",
        "added and deleted",
        "foreign encoder",
        "another corpus",
        "edited store",
    ],
)
def test_bad_input_is_one_line_naming_the_file_and_changes_nothing(world, case, capsys):
    index_dir = build_index(world, world["tmp"] / "index", "--factory", "Flat")
    options = []
    if case == "malformed line":
        world["add"].write_text(world["add"].read_text() + '{"id": "x", "title": "X"\n')
        wanted = f"{world['add']}:6"
    elif case == "unknown id":
        world["delete"].write_text("nope\n")
        wanted = f"{world['delete']}:1: passage id 'nope' is not in the corpus"
    elif case == "added and deleted":
        world["delete"].write_text("new1\n")
        wanted = f"{world['delete']}:1: passage id 'new1' is also in {world['add']}"
    elif case == "foreign encoder":
        from rlm.retriever.encoder import default_retriever_path

        options = ["--encoder", default_retriever_path()]
        wanted = "update it with the encoder its rows were embedded with"
    elif case == "another corpus":
        world["corpus"] = write_rows(world["tmp"] / "other.jsonl", corpus_rows(world["corpus"])[:119])
        wanted = "built for corpus"
    else:
        assert update(world, index_dir) == 0
        store = index_dir / "updates" / "0001" / "passages.jsonl"
        store.write_text(store.read_text().replace("bees", "wasps"))
        base = load_corpus(world["corpus"])
        index = load_index_for(index_dir, base.ids, use_gpu=False, corpus_fingerprint=base.fingerprint)
        with pytest.raises(ValueError, match="files of update 1 .* changed after it was applied"):
            served_corpus(index, base, index_dir)
        return
    before = {p.name: p.read_bytes() for p in index_dir.iterdir() if p.is_file()}
    argv = ["corpus", "update", "--index", str(index_dir), "--corpus", str(world["corpus"])]
    argv += ["--add", str(world["add"]), "--delete", str(world["delete"])]
    argv += options or ["--encoder", str(world["encoder"])]
    capsys.readouterr()
    assert main(argv) == 2
    said = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.strip() and "Loading weights" not in line
    ]
    assert len(said) == 1 and said[0].startswith("error: ") and wanted in said[0], said
    assert {p.name: p.read_bytes() for p in index_dir.iterdir() if p.is_file()} == before
    assert not (index_dir / "updates").exists() or not any((index_dir / "updates").iterdir())


@pytest.mark.slow
def test_an_update_killed_at_any_moment_leaves_the_index_as_it_was_or_done(world):
    """SIGKILL at moments through a real update (a child process, as a cluster kills one): after each, the
    folder opens with 0 or 1 updates and every answer consistent; the rerun completes it exactly once."""
    index_dir = build_index(world, world["tmp"] / "index", "--factory", "IVF2,SQ8", "--rescore", "2")
    argv = [sys.executable, "-m", "rlm", "corpus", "update", "--index", str(index_dir)]
    argv += ["--corpus", str(world["corpus"]), "--add", str(world["add"]), "--delete", str(world["delete"])]
    argv += ["--encoder", str(world["encoder"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    assert subprocess.run(argv, env=env, capture_output=True, cwd=world["tmp"]).returncode == 0
    full = time.monotonic() - start
    undone = lambda: json.loads((index_dir / "index.json").read_text()).get("edition", {}).get("updates", [])  # noqa: E731
    assert len(undone()) == 1
    index_dir = build_index(world, world["tmp"] / "killed", "--factory", "IVF2,SQ8", "--rescore", "2")
    argv[argv.index("--index") + 1] = str(index_dir)
    interrupted = 0
    for share in (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0):
        child = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=world["tmp"]
        )
        time.sleep(full * share)
        child.send_signal(signal.SIGKILL)
        child.wait()
        applied = len(undone())
        index, edition = opened(world, index_dir)  # as it was, or done: never half
        assert len(edition) == 120 + 5 * applied and len(index.removed) == 5 * applied
        if applied:
            break
        interrupted += 1
    assert interrupted  # at least one kill landed before the commit
    if not applied:  # the rerun cleans what the killed ones left and applies it once
        assert subprocess.run(argv, env=env, capture_output=True, cwd=world["tmp"]).returncode == 0
    assert len(undone()) == 1
    from rlm.retriever.index import orphans

    assert orphans(index_dir) == []


def clustered(n: int, dim: int, centers: np.ndarray, rng) -> np.ndarray:
    rows = centers[rng.integers(0, len(centers), n)] + 0.05 * rng.standard_normal((n, dim))
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def test_the_checks_say_when_new_rows_fit_the_codebooks_worse():
    """Rows like the ones the codes were trained on pass; rows from elsewhere in the space (a corpus that drifted:
    new topics) are quantized worse than the held-out baseline by more than the limit, and the update says so."""
    from rlm.inference.corpus_update import QUANTIZATION_LIMIT, outgrown

    rng = np.random.default_rng(0)
    dim = 32
    centers = rng.standard_normal((16, dim))
    rows = clustered(12_000, dim, centers, rng)
    ids = [str(i) for i in range(len(rows))]
    index = PassageIndex.build(rows, ids, "IVF16,PQ8x4", use_gpu=False, train_sample=8000)
    assert index.quantization["rows"] > 0 and not index.quantization["in_sample"]
    same = clustered(300, dim, centers, rng)
    checks, told = outgrown(index, same, len(rows))
    assert checks["quantization_ratio"] < QUANTIZATION_LIMIT and not told
    elsewhere = clustered(300, dim, rng.standard_normal((16, dim)), rng)
    checks, told = outgrown(index, elsewhere, len(rows))
    assert checks["quantization_ratio"] > QUANTIZATION_LIMIT
    assert len(told) == 1 and "rlm index --retrain DIR" in told[0]


def test_retrain_rebuilds_the_codebooks_from_the_current_rows_and_keeps_the_edition(world, capsys):
    from rlm.retriever.index import quantization_error

    index_dir = build_index(world, world["tmp"] / "ivf", "--factory", "IVF2,SQ8", "--rescore", "2")
    assert update(world, index_dir) == 0
    before, _ = opened(world, index_dir)
    new_rows = np.load(index_dir / "updates" / "0001" / "rows.npy").astype(np.float32)
    error_before = quantization_error(before.index, new_rows)
    capsys.readouterr()
    assert main(["index", "--retrain", str(index_dir)]) == 0
    assert "retrained from its 125 rows (5 removed)" in capsys.readouterr().out
    after, edition = opened(world, index_dir)
    assert json.loads((index_dir / "index.json").read_text())["generation"] == 2
    assert after.edition == before.edition and np.array_equal(after.removed, before.removed)
    assert quantization_error(after.index, new_rows) <= error_before
    queries = embed_passages(tower(world), edition.retrieval_texts(), dtype="float32")
    _, rows = after.search_rows(queries, 125)
    assert not np.isin(rows, after.removed).any() and (rows >= 0).sum(axis=1).min() == 120
    # An update after the retrain is the folder's third generation, not a second one written over the current.
    world["add"] = write_rows(
        world["tmp"] / "add2.jsonl", [{"id": "new9", "title": "Vel", "text": "Vel sings."}]
    )
    world["delete"].write_text("")
    assert update(world, index_dir) == 0
    assert json.loads((index_dir / "index.json").read_text())["generation"] == 3
    again, edition = opened(world, index_dir)
    assert len(again.edition["updates"]) == 2 and edition[edition.index_of("new9")].text == "Vel sings."


@pytest.mark.slow
def test_a_running_demo_serves_an_update_without_a_restart_and_no_question_fails(tiny_quickstart, tmp_path):
    """The service follows its index folder: while one thread keeps asking, `rlm corpus update` adds a passage;
    every answer succeeds, each names the edition it was answered on, the edition changes once, and after it the
    new passage is retrieved for its own words."""
    import threading

    from rlm.app.service import QAService, ServiceOptions
    from rlm.inference.checkpoint import corpus_from_config

    final = tiny_quickstart / "final"
    import yaml

    corpus = corpus_from_config(yaml.safe_load((final / "config.yaml").read_text()), final)
    buffer, index_dir = tmp_path / "buffer", tmp_path / "index"
    argv = ["embed", "--corpus", str(corpus), "--encoder", str(final / "retriever"), "--out", str(buffer)]
    assert main([*argv, "--no-progress"]) == 0
    assert (
        main(["index", "--buffer", str(buffer), "--out", str(index_dir), "--factory", "Flat", "--cpu"]) == 0
    )
    options = ServiceOptions(index_path=index_dir, follow_updates_s=0.05, cache_dir=tmp_path / "cache")
    service = QAService.from_checkpoint(final, corpus, options)
    before = service.edition
    seen, failures, stop = [], [], threading.Event()

    def ask() -> None:
        while not stop.is_set():
            try:
                seen.append(service.answer("Where does Quillon Avesta keep bees?", 2)["corpus_edition"])
            except Exception as err:  # every one must be answered
                failures.append(err)

    asker = threading.Thread(target=ask)
    asker.start()
    add = write_rows(
        tmp_path / "add.jsonl",
        [{"id": "bees", "title": "Quillon Avesta", "text": "Quillon Avesta keeps bees in Morvale."}],
    )
    update = ["corpus", "update", "--index", str(index_dir), "--corpus", str(corpus), "--add", str(add)]
    assert main([*update, "--checkpoint", str(final)]) == 0
    deadline = time.monotonic() + 60
    while service.edition == before and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    stop.set()
    asker.join()
    assert not failures, failures[:3]
    assert service.edition != before and set(seen) == {before, service.edition}
    assert seen.index(service.edition) > 0 and all(
        e == service.edition for e in seen[seen.index(service.edition) :]
    )
    found = service.answer("Quillon Avesta keeps bees in Morvale.", 2)["passages"]
    assert "bees" in [p["id"] for p in found]


@pytest.mark.slow
def test_an_index_over_h_of_b_takes_new_passages_through_g0_then_h(tiny_quickstart, tmp_path, capsys):
    """The corrector's own case: an index over h(B) (the run's fixed buffer through its corrector, nothing
    re-embedded) takes a new passage as the run's starting encoder g0 embeds it, corrected by h, as every row."""
    import torch
    import yaml

    from rlm.components import build_retriever
    from rlm.config import load_config
    from rlm.inference.checkpoint import corpus_from_config
    from rlm.inference.corrected_index import corrected_index
    from rlm.retriever.corrector import CorrectorNetwork

    final = tiny_quickstart / "final"
    corpus_file = corpus_from_config(yaml.safe_load((final / "config.yaml").read_text()), final)
    corpus = load_corpus(corpus_file)
    built = corrected_index(final, corpus, device="cpu")
    index_dir = tmp_path / "hb"
    built.index.save(index_dir)
    add = write_rows(
        tmp_path / "add.jsonl",
        [{"id": "bees", "title": "Quillon Avesta", "text": "Quillon Avesta keeps bees in Morvale."}],
    )
    argv = ["corpus", "update", "--index", str(index_dir), "--corpus", str(corpus_file), "--add", str(add)]
    assert main([*argv, "--checkpoint", str(final)]) == 0
    index, edition = opened({"corpus": corpus_file}, index_dir)
    g0 = build_retriever(load_config(final / "config.yaml")).passage_tower
    h = CorrectorNetwork.from_pretrained(final / "corrector").eval()
    stale = embed_passages(g0, ["Quillon Avesta. Quillon Avesta keeps bees in Morvale."], dtype="float16")
    with torch.no_grad():
        expected = h(torch.from_numpy(stale).float()).numpy()
    stored = np.load(index_dir / "updates" / "0001" / "rows.npy").astype(np.float32)
    np.testing.assert_allclose(stored, expected, atol=2e-3)
    _, top = index.search(expected, 1)
    assert top[0] == ["bees"] and edition[edition.index_of("bees")].text.endswith("bees in Morvale.")
    # The run's trained passage tower did not make these rows: an --encoder of it is refused.
    other = ["--encoder", str(final / "retriever")]
    assert main([*argv[:-2], "--add", str(add), *other]) == 2
    assert "update it with the encoder its rows were embedded with" in capsys.readouterr().err
