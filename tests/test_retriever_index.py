"""faiss inference index: exact Flat search, IVF training, atomic save/load with ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.index import PassageIndex


def unit_vectors(n, d, seed):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_flat_is_exact_inner_product_and_roundtrips(tmp_path):
    emb, queries = unit_vectors(500, 16, 0), unit_vectors(3, 16, 1)
    ids = [f"p{i}" for i in range(500)]
    index = PassageIndex.build(emb, ids)
    scores, found = index.search(queries, 5)
    ref = queries @ emb.T
    order = np.argsort(-ref, axis=1)[:, :5]
    assert found == [[ids[j] for j in row] for row in order]
    np.testing.assert_allclose(scores, np.take_along_axis(ref, order, 1), atol=1e-5)
    index.save(tmp_path / "idx")
    again = PassageIndex.load(tmp_path / "idx")
    assert again.ids == ids and again.factory == "Flat" and again.ntotal == 500
    assert again.search(queries, 5)[1] == found
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"], "no temporaries left behind"
    assert index.search(queries, 10_000)[0].shape == (3, 500)


def test_ivf_is_trained_and_finds_the_neighbours(tmp_path):
    emb = unit_vectors(2000, 16, 2)
    index = PassageIndex.build(emb, [str(i) for i in range(2000)], factory="IVF16,Flat", train_sample=1000)
    assert index.index.is_trained
    queries = emb[:20]
    _, found = index.search(queries, 1, nprobe=16)
    assert [row[0] for row in found] == [str(i) for i in range(20)]
    index.save(tmp_path / "ivf")
    assert PassageIndex.load(tmp_path / "ivf").search(queries, 1, nprobe=16)[1] == found


def test_from_buffer_streams_shards_in_row_order():
    emb = torch.from_numpy(unit_vectors(300, 8, 3)).half()
    buffer = PassageBuffer([f"d{i}" for i in range(300)], [emb[:100], emb[100:]])
    index = PassageIndex.from_buffer(buffer, "Flat", chunk_size=64)
    scores, rows = index.search_rows(emb[250:253].float().numpy(), 1)
    assert rows[:, 0].tolist() == [250, 251, 252]


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="cannot build index type 'Nonsense'"):
        PassageIndex.build(unit_vectors(10, 4, 0), [str(i) for i in range(10)], factory="Nonsense")
    with pytest.raises(ValueError, match="10 embeddings but 3 ids"):
        PassageIndex.build(unit_vectors(10, 4, 0), ["a", "b", "c"])
    with pytest.raises(FileNotFoundError, match="rlm index"):
        PassageIndex.load(tmp_path)
    with pytest.raises(ValueError, match=r"\[n, 4\]"):
        PassageIndex.build(unit_vectors(10, 4, 0), [str(i) for i in range(10)]).search(
            unit_vectors(2, 5, 0), 1
        )


def test_two_stage_auto_index_is_ivf_with_fp16_storage_and_ranks_like_flat():
    """`strategy.index_factory: auto` above 100k rows is IVF with fp16 storage (of each row's offset from its list
    centre): searched over every list it scores an fp16 buffer within ~1e-4 of Flat, with the same top rows."""
    from rlm.retriever.index_spec import auto_index_factory

    assert auto_index_factory(99_999) == "Flat"
    assert auto_index_factory(1_000_000) == "IVF4000,SQfp16"
    g = torch.Generator().manual_seed(0)
    rows = torch.nn.functional.normalize(torch.randn(3000, 32, generator=g), dim=-1).half()
    buffer = PassageBuffer.from_embeddings([str(i) for i in range(len(rows))], rows)
    queries = torch.nn.functional.normalize(torch.randn(5, 32, generator=g), dim=-1).numpy()
    flat_scores, flat_rows = PassageIndex.from_buffer(buffer, "Flat").search_rows(queries, 20)
    sq = PassageIndex.from_buffer(buffer, "IVF16,SQfp16")  # the auto type, scaled to 3,000 rows
    sq_scores, sq_rows = sq.search_rows(queries, 20, nprobe=16)
    np.testing.assert_allclose(sq_scores, flat_scores, atol=5e-4)
    same = np.mean([len(set(a) & set(b)) / 20 for a, b in zip(sq_rows.tolist(), flat_rows.tolist())])
    assert same >= 0.95


def recall_at(index, queries, exact, k):
    _, found = index.search_rows(queries, k)
    return float((found[:, :, None] == exact[:, None, :]).any(-1).sum(-1).mean() / k)


def test_search_parameters_are_tuned_for_a_target_recall_saved_and_applied_on_load(tmp_path):
    emb = unit_vectors(4000, 32, 5)
    queries = unit_vectors(200, 32, 6)
    exact = np.argsort(-(queries @ emb.T), axis=1)[:, :10]
    index = PassageIndex.build(emb, [f"p{i}" for i in range(4000)], factory="IVF64,Flat")
    # faiss's default probes one list of 64: most of the true neighbours are missed.
    assert index.tunable_parameter() == "nprobe" and recall_at(index, queries, exact, 10) < 0.5
    tuning = index.tune(emb, target_recall=0.9, k=10, queries=300)
    assert tuning["parameter"] == "nprobe" and tuning["recall"] >= 0.9 and tuning["k"] == 10
    nprobe = tuning["value"]
    assert 1 < nprobe < 64 and index.search_params == {"nprobe": nprobe}
    assert all(r < 0.9 for v, r in tuning["tried"].items() if int(v) < nprobe)  # the smallest that reaches it
    assert recall_at(index, queries, exact, 10) >= 0.85  # new queries, not the tuning sample
    index.save(tmp_path / "idx")
    loaded = PassageIndex.load(tmp_path / "idx")
    assert loaded.search_params == {"nprobe": nprobe} and loaded.tuning["recall"] == tuning["recall"]
    assert (loaded.search_rows(queries, 10)[1] == index.search_rows(queries, 10)[1]).all()
    # A caller's choice wins over the saved one.
    cheap = PassageIndex.load(tmp_path / "idx", search_params={"nprobe": 1})
    assert cheap.search_params == {"nprobe": 1} and recall_at(cheap, queries, exact, 10) < 0.5
    with pytest.raises(ValueError, match="no search parameter 'efSearch'"):
        PassageIndex.load(tmp_path / "idx", search_params={"efSearch": 64})


def test_hnsw_tunes_ef_search_and_exact_indexes_have_nothing_to_tune():
    emb = unit_vectors(3000, 32, 7)
    hnsw = PassageIndex.build(emb, [str(i) for i in range(3000)], factory="HNSW8")
    tuning = hnsw.tune(emb, target_recall=0.99, k=20, queries=200)
    assert tuning["parameter"] == "efSearch" and hnsw.search_params == {"efSearch": tuning["value"]}
    assert tuning["recall"] >= 0.99 or tuning["value"] == 2048
    flat = PassageIndex.build(emb, [str(i) for i in range(3000)])
    assert flat.tunable_parameter() is None and flat.tune(emb) == {} and flat.search_params == {}


def test_tuning_a_compressed_index_stops_where_probing_more_gains_nothing():
    """PQ codes cap recall below the target: `tune` stops where doubling nprobe gains less than
    `RECALL_PLATEAU` (with a warning) instead of probing every list, which at 21M costs seconds a query."""
    from rlm.retriever.index import RECALL_PLATEAU

    emb = unit_vectors(4000, 32, 8)
    index = PassageIndex.build(emb, [str(i) for i in range(4000)], factory="IVF64,PQ4x4")
    with pytest.warns(UserWarning, match="below the target"):
        tuning = index.tune(emb, target_recall=0.99, k=20, queries=300)
    tried = {int(v): r for v, r in tuning["tried"].items()}
    assert (
        tuning["recall"] < 0.99 and tuning["value"] < 64 and index.search_params["nprobe"] == tuning["value"]
    )
    after = min(v for v in tried if v > tuning["value"])  # the doubling that gained (almost) nothing
    assert tried[after] - tried[tuning["value"]] < RECALL_PLATEAU


def test_an_ivf_index_is_trained_on_enough_rows_for_its_lists():
    """faiss's k-means wants about 40 rows a list: IVF16384 (the 21M recommendation's scale) is trained on
    655,360 rows, not the 262,144 that suit up to 6,553 lists."""
    from rlm.retriever.index import TRAIN_SAMPLE, training_rows

    assert training_rows("Flat") == training_rows("HNSW32,SQ8") == TRAIN_SAMPLE == 262_144
    assert training_rows("IVF1024,PQ64") == TRAIN_SAMPLE
    assert training_rows("IVF16384,PQ256np") == 655_360
    assert training_rows("OPQ64_768,IVF65536_HNSW32,PQ64") == 2_621_440


def test_an_index_tuned_without_questions_probes_as_far_as_questions_need():
    """Rows sit in their own IVF list: tuned on bare rows, this index probed 1 list of 64 and found under 80% of
    the held-out questions' exact top-20. Questions fall between clusters (here: between two of 64 tight
    ones, a shape `question_like_rows` does not draw), and the rows it makes question-like ask as much of the
    search as they do; tuned on such questions themselves (`query_vectors`, what `rlm evaluate` and `rlm index
    --tune-questions` pass), the index finds them too."""
    rng = np.random.default_rng(0)
    centers = unit_vectors(64, 32, 11)
    members = centers.repeat(50, axis=0) + 0.05 * rng.standard_normal((3200, 32)).astype(np.float32)
    emb = members / np.linalg.norm(members, axis=1, keepdims=True)

    def between(n, seed):
        pick = np.random.default_rng(seed).integers(0, 64, size=(n, 2))
        mid = centers[pick[:, 0]] + centers[pick[:, 1]]
        return (mid / np.linalg.norm(mid, axis=1, keepdims=True)).astype(np.float32)

    asked, held_out = between(300, 1), between(200, 2)
    exact = np.argsort(-(held_out @ emb.T), axis=1)[:, :20]
    ids = [str(i) for i in range(3200)]
    on_rows = PassageIndex.build(emb, ids, factory="IVF64,Flat")
    tuning = on_rows.tune(emb, target_recall=0.9, k=20, queries=300)
    assert recall_at(on_rows, held_out, exact, 20) >= 0.85
    assert tuning["queries_from"] == "question-like rows" and tuning["queries"] == 300
    on_questions = PassageIndex.build(emb, ids, factory="IVF64,Flat")
    tuning = on_questions.tune(emb, target_recall=0.9, k=20, query_vectors=asked)
    assert tuning["queries_from"] == "query vectors" and tuning["queries"] == 300
    assert recall_at(on_questions, held_out, exact, 20) >= 0.85


def test_an_index_tuned_by_default_loses_at_most_a_point_of_the_answers_exact_search_finds():
    """The issue's goal is the gold passage's recall@20 within 1 point of exact search. On the index study's
    model of passages and questions (scripts/bench/bench_index.py: topics, documents, questions drawn around one
    passage each) at 32k passages, the old default (recall@100 >= 0.95 of exact search's neighbours, on made
    questions) stopped at nprobe 4 of 32 and held-out questions lost 3.8 points of gold recall@20; the default
    now counts the made questions' own source rows (the answers a reader would lose) and keeps 99.5% of those
    exact search finds: nprobe 16 here, 0.2 points lost (over 5 corpora x 2 tuning seeds: 0.0-1.1, mean 0.3;
    at a target of 0.99, 0.1-1.3, mean 0.8)."""
    from script_loader import load_script

    from rlm.retriever.index import DEFAULT_TARGET_RECALL, TUNE_K

    passages, questions, gold = load_script("bench_index").synthetic(32_000, 1_000, seed=0)
    index = PassageIndex.build(passages, [str(i) for i in range(len(passages))], factory="IVF32,Flat")
    tuning = index.tune(passages)  # what `rlm index --factory IVF32,Flat` does without flags
    assert tuning["measure"] == "source rows kept" and tuning["recall"] >= DEFAULT_TARGET_RECALL == 0.995
    assert tuning["k"] == TUNE_K == 20 and set(tuning["tried_top_k_found"]) == set(tuning["tried"])

    def gold_recall_at_20(found):
        return float((found[:, :20] == gold[:, None]).any(-1).mean())

    exact = np.argsort(-(questions @ passages.T), axis=1)[:, :20]
    lost = gold_recall_at_20(exact) - gold_recall_at_20(index.search_rows(questions, 20)[1])
    assert gold_recall_at_20(exact) > 0.7 and lost <= 0.01, (tuning["value"], lost)


def test_tune_goes_on_while_the_answers_kept_grow_though_the_neighbours_found_do_not():
    """PQ codes cap the share of exact search's top 20 an IVF index finds sooner than the share of the answers it
    keeps: over 32k passages of the index study's model (128-d here), `IVF32,PQ16np` found 0.1% more of the
    neighbours going from nprobe 8 to 16 (under `RECALL_PLATEAU`) and kept 0.5% more of the answers, and `tune`
    stopped at 8 (on real text, SQ8 in HNSW: 0.973 of the answers kept where 0.991 was a doubling away). It
    stops only where a doubling gains less than `RECALL_PLATEAU` in both."""
    from script_loader import load_script

    from rlm.retriever.index import RECALL_PLATEAU

    study = load_script("bench_index")  # a fresh module: its width is this test's
    study.D = 128
    passages, _, _ = study.synthetic(32_000, 1, seed=0)
    index = PassageIndex.build(passages, [str(i) for i in range(len(passages))], factory="IVF32,PQ16np")
    with pytest.warns(UserWarning, match="below the target"):  # the codes cap it below 0.995
        tuning = index.tune(passages)
    kept = {int(v): r for v, r in tuning["tried"].items()}
    found = {int(v): r for v, r in tuning["tried_top_k_found"].items()}
    chosen = tuning["value"]
    after = min(v for v in kept if v > chosen)  # the doubling that gained (almost) nothing
    assert kept[after] - kept[chosen] < RECALL_PLATEAU and found[after] - found[chosen] < RECALL_PLATEAU
    assert chosen >= 16 and kept[chosen] > kept[8] + 0.003


def test_made_questions_whose_sources_exact_search_never_finds_are_tuned_on_the_neighbours(monkeypatch):
    """Where no made question's source row is in its exact top k (a corpus of near-duplicates, where ties rank
    other copies first), there are no answers to keep: `tune` counts exact search's top k found instead, and
    says so, rather than dividing by zero."""
    import rlm.retriever.index as index_module

    emb = unit_vectors(2000, 16, 4)
    made = torch.from_numpy(unit_vectors(200, 16, 5))
    far = np.argsort(made.numpy() @ emb.T, axis=1)[:, 0]  # each question's farthest row as its "source"
    monkeypatch.setattr(index_module, "question_like_rows", lambda rows, count, rng: (made, far, {}))
    index = PassageIndex.build(emb, [str(i) for i in range(2000)], factory="IVF16,Flat")
    tuning = index.tune(emb, target_recall=0.9, k=10)
    assert tuning["measure"] == "exact top-k found" and tuning["queries_from"] == "question-like rows"
    assert tuning["recall"] >= 0.9 and "tried_top_k_found" not in tuning


def test_question_like_rows_are_found_by_exact_search_as_often_as_a_retriever_finds_answers():
    """Each made question is its row plus noise of the corpus's spread, scaled so that exact search ranks the
    row in its top 20 for 80% of them (DPR's top-20 on NQ: 79%): on rows of 40 tight documents the noise
    takes a row out of its document's cluster, and none of the rows asks like itself."""
    from rlm.retriever.index import question_like_rows

    rng = np.random.default_rng(3)
    centers = unit_vectors(40, 32, 12)
    members = centers.repeat(100, axis=0) + 0.1 * rng.standard_normal((4000, 32)).astype(np.float32)
    emb = members / np.linalg.norm(members, axis=1, keepdims=True)
    rows = PassageBuffer.from_embeddings([str(i) for i in range(4000)], torch.from_numpy(emb))
    made, source, chosen = question_like_rows(rows, 500, np.random.default_rng(0))
    assert made.shape == (500, 32) and chosen["found_within"] == 20 and 0.0 < chosen["noise_scale"] < 8.0
    np.testing.assert_allclose(made.norm(dim=-1).numpy(), 1.0, atol=1e-5)
    top20 = np.argsort(-(made.numpy() @ emb.T), axis=1)[:, :20]
    assert source.shape == (500,) and len(set(source.tolist())) == 500  # distinct rows, each one's own source
    found = (top20 == source[:, None]).any(-1).mean()
    assert 0.7 <= found <= 0.9
    assert (top20[:, 0] == source).mean() < 0.9  # a bare row would always rank itself first


def buffer_folder(folder, rows, shard_size, encoder="encoder-a"):
    """A buffer folder as `rlm embed` writes one (float16 shards, receipts, ids, meta.json) over `rows`."""
    from rlm.retriever.buffer import FORMAT_VERSION, finalize_buffer, write_shard

    count, dim = rows.shape
    settings = {
        "format_version": FORMAT_VERSION,
        "encoder_fingerprint": encoder,
        "corpus_fingerprint": "corpus-a",
        "count": count,
        "dim": dim,
        "dtype": "float16",
        "shard_size": shard_size,
        "num_shards": -(-count // shard_size),
        "max_length": 32,
        "precision": "float32",
    }
    folder.mkdir()
    for s in range(settings["num_shards"]):
        write_shard(folder, s, rows[s * shard_size : (s + 1) * shard_size].astype(np.float16))
    finalize_buffer(folder, [f"p{i}" for i in range(count)], settings)
    return PassageBuffer.load(folder)


def test_rescoring_from_the_buffer_on_disk_lifts_what_pq_codes_cap_and_is_saved_with_the_index(tmp_path):
    """PQ codes of 8 bytes find about half of exact search's top 10; the same codes with their top 16 x k
    re-scored exactly from the float16 rows on disk (three memory-mapped shards) find nearly all of it, scored
    as exact search scores them, and the index reopens its buffer when loaded. An index whose buffer moved, or
    re-scored from the rows of another encoder or corpus size, is refused in words that name what to do."""
    emb, queries = unit_vectors(4000, 32, 8), unit_vectors(200, 32, 9)
    buffer = buffer_folder(tmp_path / "buffer", emb, shard_size=1500)
    stored = buffer.embeddings.float().numpy()
    exact = np.argsort(-(queries @ stored.T), axis=1, kind="stable")[:, :10]
    bare = PassageIndex.from_buffer(buffer, "IVF16,PQ16x4np")
    bare.set_search_params({"nprobe": 16})
    index = PassageIndex.from_buffer(buffer, "IVF16,PQ16x4np")
    index.set_search_params({"nprobe": 16})
    index.rescore_from(buffer, 16)
    assert recall_at(bare, queries, exact, 10) < 0.6 < 0.95 <= recall_at(index, queries, exact, 10)
    scores, rows = index.search_rows(queries, 10)
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ stored.T, rows, 1), rtol=1e-5, atol=1e-6)
    assert (np.diff(scores, axis=1) <= 0).all()

    index.save(tmp_path / "idx")
    loaded = PassageIndex.load(tmp_path / "idx")
    assert loaded.rescoring.k_factor == 16 and loaded.rescoring.rows.path == buffer.path
    assert (loaded.search_rows(queries, 10)[1] == rows).all()
    (tmp_path / "buffer").rename(tmp_path / "moved")
    with pytest.raises(ValueError, match="re-scores its candidates from a buffer found at none of: .*buffer"):
        PassageIndex.load(tmp_path / "idx")
    other = buffer_folder(tmp_path / "other", emb, shard_size=4000, encoder="encoder-b")
    with pytest.raises(ValueError, match="encoder fingerprint encoder-b, the index with encoder-a"):
        loaded.rescore_from(other, 8)
    smaller = buffer_folder(tmp_path / "smaller", emb[:100], shard_size=100)
    with pytest.raises(ValueError, match="hold 100 x 32, the index 4000 x 32"):
        loaded.rescore_from(smaller, 8)
    in_memory = PassageIndex.build(emb, [f"p{i}" for i in range(4000)])
    in_memory.rescore_from(PassageBuffer.from_embeddings(range(4000), torch.from_numpy(emb)), 2)
    with pytest.raises(ValueError, match="cannot be saved"):
        in_memory.save(tmp_path / "mem")
    assert not (tmp_path / "mem").exists()
    on_device = PassageBuffer.from_embeddings(range(4000), torch.from_numpy(emb)).to("meta")  # as on a GPU
    with pytest.raises(ValueError, match="rows on meta: re-scoring reads them on the host"):
        in_memory.rescore_from(on_device, 2)  # was taken, and each search then mixed devices


def test_rescoring_asks_for_every_candidate_row_from_disk_at_once(tmp_path, monkeypatch):
    """Rows of a memory-mapped buffer that are not in the page cache are read one page fault after another; so
    `Rescoring.best` first tells the kernel every candidate row it will read (`PassageBuffer.prefetch`:
    `posix_fadvise(WILLNEED)` on exactly each row's bytes in its shard file), and the result is the same."""
    import os

    emb, queries = unit_vectors(300, 16, 4), unit_vectors(3, 16, 5)
    buffer = buffer_folder(tmp_path / "buffer", emb, shard_size=128)  # 3 shards: 128, 128, 44 rows
    index = PassageIndex.from_buffer(buffer, "IVF4,PQ4x4np")
    index.set_search_params({"nprobe": 4})
    index.rescore_from(buffer, 5)
    quiet = index.search_rows(queries, 4)
    asked = []
    monkeypatch.setattr(
        os, "posix_fadvise", lambda fd, offset, length, advice: asked.append((fd, offset, length, advice))
    )
    scores, rows = index.search_rows(queries, 4)
    np.testing.assert_array_equal(rows, quiet[1])
    np.testing.assert_array_equal(scores, quiet[0])
    _, candidates = index.index.search(queries, 20)
    header = np.load(tmp_path / "buffer" / "shard_00000.npy", mmap_mode="r").offset
    expected = sorted(
        (f"shard_{row // 128:05d}.npy", header + (row % 128) * 16 * 2)
        for row in candidates.reshape(-1)
        if row >= 0
    )
    named = {fd: os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[1] for fd, *_ in asked}
    assert sorted((named[fd], offset) for fd, offset, _, _ in asked) == expected
    assert {(length, advice) for _, _, length, advice in asked} == {(32, os.POSIX_FADV_WILLNEED)}
    in_memory = PassageBuffer.from_embeddings(range(300), torch.from_numpy(emb))
    asked.clear()
    in_memory.prefetch(torch.arange(10))
    assert asked == []  # nothing on disk to ask for


def rescored_index(folder, emb, encoder="encoder-a"):
    """`folder/buffer` (as `rlm embed` writes one) and `folder/index`, an IVF-PQ index re-scored from it."""
    folder.mkdir()
    buffer = buffer_folder(folder / "buffer", emb, shard_size=700, encoder=encoder)
    index = PassageIndex.from_buffer(buffer, "IVF8,PQ8x4np")
    index.set_search_params({"nprobe": 8})
    index.rescore_from(buffer, 8)
    index.save(folder / "index")
    return index


def test_an_index_copied_with_its_embeddings_to_another_folder_serves_the_same_answers(tmp_path):
    """index.json records the buffer relative to the index: a copy of both elsewhere (another machine) opens
    the copied buffer, the original gone or not, and answers exactly as the original did."""
    import shutil

    emb, queries = unit_vectors(2000, 16, 10), unit_vectors(30, 16, 11)
    rescored_index(tmp_path / "run", emb)
    before = PassageIndex.load(tmp_path / "run" / "index").search(queries, 10)
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    copied = PassageIndex.load(tmp_path / "copy" / "index")
    assert copied.rescoring.rows.path == (tmp_path / "copy" / "buffer").resolve()  # its own, not the original
    (tmp_path / "run").rename(tmp_path / "gone")
    after = PassageIndex.load(tmp_path / "copy" / "index").search(queries, 10)
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1] == before[1]


def test_an_index_moved_alone_finds_its_buffer_where_it_was_built_and_skips_a_foreign_one(tmp_path):
    """Moved without its buffer, an index falls back to the buffer's absolute folder; a buffer of another
    encoder at the relative place is not taken for it (the provenance check holds after a move)."""
    emb, queries = unit_vectors(1500, 16, 12), unit_vectors(10, 16, 13)
    before = rescored_index(tmp_path / "run", emb).search(queries, 5)[1]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run" / "index").rename(tmp_path / "elsewhere" / "index")
    buffer_folder(tmp_path / "elsewhere" / "buffer", emb, shard_size=1500, encoder="encoder-b")
    moved = PassageIndex.load(tmp_path / "elsewhere" / "index")
    assert moved.rescoring.rows.path == (tmp_path / "run" / "buffer").resolve()
    assert moved.search(queries, 5)[1] == before


def test_an_index_whose_buffer_went_elsewhere_says_so_and_reopens_it_where_it_is_told(tmp_path):
    emb, queries = unit_vectors(1500, 16, 14), unit_vectors(10, 16, 15)
    before = rescored_index(tmp_path / "run", emb).search(queries, 5)[1]
    (tmp_path / "run" / "buffer").rename(tmp_path / "moved")
    with pytest.raises(ValueError, match="found at none of: .*run/buffer .*--rescore-buffer DIR"):
        PassageIndex.load(tmp_path / "run" / "index")
    told = PassageIndex.load(tmp_path / "run" / "index", rescore_rows=tmp_path / "moved")
    assert told.search(queries, 5)[1] == before
    buffer_folder(tmp_path / "foreign", emb, shard_size=1500, encoder="encoder-b")
    with pytest.raises(ValueError, match="encoder fingerprint encoder-b, the index with encoder-a"):
        PassageIndex.load(tmp_path / "run" / "index", rescore_rows=tmp_path / "foreign")


def test_an_index_built_and_tuned_from_a_float16_npy_never_holds_a_float32_copy_of_it(tmp_path):
    """A memory-mapped float16 file is added a block at a time and searched exactly in chunks while the index is
    tuned: no float32 copy of all rows (what 21M x 768 makes 64 GB) is ever made beside the index."""
    import tracemalloc

    n, d = 200_000, 32
    emb = np.lib.format.open_memmap(tmp_path / "emb.npy", mode="w+", dtype=np.float16, shape=(n, d))
    for start in range(0, n, 50_000):
        emb[start : start + 50_000] = unit_vectors(50_000, d, start)
    emb.flush()
    del emb
    mapped = np.load(tmp_path / "emb.npy", mmap_mode="r")
    whole_float32 = n * d * 4
    PassageIndex.build(mapped[:2000], range(2000), "IVF4,Flat").tune(mapped[:2000], queries=20)  # the imports
    tracemalloc.start()
    try:
        index = PassageIndex.build(mapped, range(n), "IVF64,Flat", train_sample=5000)
        index.tune(mapped, queries=200)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.ntotal == n and index.tuning["value"] >= 1
    assert peak < 0.6 * whole_float32, f"peak {peak / 2**20:.1f} MiB of numpy arrays"


# Loads an index in a fresh process and reports how much private memory that took: in the test's own process
# the allocator may hand the load memory an earlier build freed, which a measure of growth would not see.
_LOAD_AND_MEASURE = """
import json, sys
import numpy as np
from rlm.retriever.index import PassageIndex

def private_bytes():  # Linux's RssAnon: what this process holds that no other shares (a mapped file: not here)
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

folder, how, queries, nprobe = sys.argv[1], sys.argv[2], np.load(sys.argv[3]), int(sys.argv[4])
import faiss, torch  # what a load imports on first use is no part of the index (5 MiB)
before = private_bytes()
index = PassageIndex.load(folder, use_gpu=False, search_params={"nprobe": nprobe} if nprobe else None,
                          mmap=how == "mmap")
scores, ids = index.search(queries, 10)
grown = private_bytes() - before
print(json.dumps({"mapped": index.mapped, "grown": grown, "ids": ids, "scores": scores.tolist()}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="RssAnon is Linux's")
@pytest.mark.parametrize("factory, flag", [("Flat", "IO_FLAG_MMAP_IFC"), ("IVF16,Flat", "IO_FLAG_MMAP")])
def test_an_index_loaded_memory_mapped_answers_alike_without_a_private_copy_of_its_rows(
    tmp_path, factory, flag
):
    """`load(mmap=True)`, as the other processes of a launched evaluation load the main one's index: the same
    answers as a full read, with the stored rows mapped from the file (one copy in the page cache for every
    process) instead of read into this process's own memory."""
    import json
    import subprocess
    import sys

    n, d = 65_536, 128  # 32 MiB of float32 rows
    index = PassageIndex.build(unit_vectors(n, d, 3), range(n), factory, use_gpu=False, train_sample=4096)
    index.save(tmp_path / "idx")
    np.save(tmp_path / "queries.npy", unit_vectors(8, d, 4))
    size = (tmp_path / "idx" / "index.faiss").stat().st_size
    nprobe = "16" if "IVF" in factory else "0"

    def loaded(how: str) -> dict:
        argv = [str(tmp_path / "idx"), how, str(tmp_path / "queries.npy"), nprobe]
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_AND_MEASURE, *argv],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    mapped, whole = loaded("mmap"), loaded("read")
    assert (mapped["mapped"], whole["mapped"]) == (flag, None)
    assert mapped["ids"] == whole["ids"] and mapped["scores"] == whole["scores"]
    assert mapped["grown"] < size / 4 < 3 * size / 4 < whole["grown"], (mapped["grown"], whole["grown"], size)


def test_the_index_types_faiss_cannot_map_are_read_whole(tmp_path):
    """Fast-scan codes (`x4fs`) have no mapped form in faiss: `load(mmap=True)` reads them, and says so; IVF
    types map their inverted lists, the others their codes (and an HNSW graph)."""
    from rlm.retriever.index import mmap_flag

    emb = unit_vectors(1000, 16, 5)
    PassageIndex.build(emb, range(1000), "PQ4x4fs", use_gpu=False).save(tmp_path / "fs")
    mapped, whole = (PassageIndex.load(tmp_path / "fs", use_gpu=False, mmap=m) for m in (True, False))
    assert mapped.mapped is None and mapped.search(emb[:5], 3)[1] == whole.search(emb[:5], 3)[1]
    assert mmap_flag("IVF64,PQ32x4fs") is None
    assert mmap_flag("IVF65536_HNSW32,PQ256") == mmap_flag("OPQ64,IVF1024,PQ64") == "IO_FLAG_MMAP"
    assert mmap_flag("HNSW32,SQ8") == mmap_flag("Flat") == "IO_FLAG_MMAP_IFC"


def test_an_hnsw_coarse_quantizer_finds_as_many_lists_as_nprobe_asks_for(tmp_path):
    """faiss leaves an HNSW quantizer's efSearch at 16, which caps the lists it finds whatever nprobe says: with
    every list probed, `IVF256_HNSW32,Flat` must be exact search (it found 0.78 of its top 20 without the fix),
    and the setting must survive a save and load."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((256 * 40, 128)).astype(np.float32)
    queries = rng.standard_normal((200, 128)).astype(np.float32)
    exact = PassageIndex.build(rows, [str(i) for i in range(len(rows))], "Flat", use_gpu=False)
    _, want = exact.search_rows(queries, 20)
    index = PassageIndex.build(rows, [str(i) for i in range(len(rows))], "IVF256_HNSW32,Flat", use_gpu=False)
    index.set_search_params({"nprobe": 256})
    _, found = index.search_rows(queries, 20)
    assert (found == want).mean() > 0.999
    index.save(tmp_path / "index")
    _, again = PassageIndex.load(tmp_path / "index").search_rows(queries, 20)
    assert np.array_equal(again, found)
