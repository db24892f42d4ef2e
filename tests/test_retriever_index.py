"""faiss inference index: exact Flat search, IVF training, atomic save/load with ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retriever.buffer import PassageBuffer
from retriever.index import PassageIndex


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
    from retriever.row_search import auto_index_factory

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
    from retriever.index import RECALL_PLATEAU

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
    from retriever.index import TRAIN_SAMPLE, training_rows

    assert training_rows("Flat") == training_rows("HNSW32,SQ8") == TRAIN_SAMPLE == 262_144
    assert training_rows("IVF1024,PQ64") == TRAIN_SAMPLE
    assert training_rows("IVF16384,PQ256np") == 655_360
    assert training_rows("OPQ64_768,IVF65536_HNSW32,PQ64") == 2_621_440


def test_an_index_tuned_on_questions_finds_what_rows_as_queries_would_not_ask_for():
    """Rows sit in their own IVF list: an index tuned on them probes one list. Questions fall between clusters
    (here: between two of 64 tight ones), and their exact top-k spans lists; tuned on such queries
    (`query_vectors`, what `rlm evaluate` and `rlm index --tune-questions` pass), the index finds it."""
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
    on_rows.tune(emb, target_recall=0.9, k=20, queries=300)
    on_questions = PassageIndex.build(emb, ids, factory="IVF64,Flat")
    tuning = on_questions.tune(emb, target_recall=0.9, k=20, query_vectors=asked)
    assert tuning["queries_from"] == "query vectors" and tuning["queries"] == 300
    assert on_rows.search_params["nprobe"] < on_questions.search_params["nprobe"]
    assert (
        recall_at(on_rows, held_out, exact, 20) < 0.8 <= 0.85 <= recall_at(on_questions, held_out, exact, 20)
    )
