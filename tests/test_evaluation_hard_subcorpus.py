"""Hard subcorpus H_k: construction, loading, and how its metrics track the full corpus across checkpoints."""

import json
import math

import pytest
import torch
from script_loader import load_script

from rlm.data.corpus import load_corpus
from rlm.data.qa import load_qa_dataset
from rlm.data.toy_world import build_toy_world
from rlm.inference import evaluation, indexing
from rlm.training.hard_subcorpus import (
    build_hard_subcorpus,
    load_subcorpus,
    rank_correlation,
    save_subcorpus_ids,
    track_checkpoints,
)


@pytest.fixture(scope="module")
def world_and_minilm(tmp_path_factory, minilm_path):
    """(paths, corpus, dev, MiniLM, folder) of a 200-passage world with 16 dev questions: its own, not the
    session's tiny world (11 dev questions over 120 passages), so that H_5 stays a strict subset and a noisy
    query tower's drop in gold recall@1 shows over enough questions. The test that changes MiniLM's weights
    puts them back."""
    from rlm.retriever.encoder import DualEncoder

    root = tmp_path_factory.mktemp("hard")
    paths = build_toy_world(root / "world", num_passages=200, seed=2, max_questions={"dev": 16})
    retriever = DualEncoder.from_pretrained(minilm_path)
    return paths, load_corpus(paths.corpus), load_qa_dataset("toy", "dev", paths.root), retriever, root


def test_hard_subcorpus_keeps_gold_and_initial_top_k(world_and_minilm, tmp_path):
    paths, corpus, dev, retriever, _ = world_and_minilm
    index = indexing.build_index(
        indexing.embed_corpus(retriever.passage_tower, corpus.retrieval_texts()), corpus.ids
    )
    ids = build_hard_subcorpus(corpus, dev, retriever, k=5, index=index)
    gold = {pid for q in dev for pid in q.gold_passage_ids}
    assert gold <= set(ids) and len(ids) <= len(gold) + 5 * len(dev) and len(ids) < len(corpus)
    assert ids == sorted(ids, key=corpus.index_of)
    save_subcorpus_ids(ids, tmp_path / "h.txt")
    subset = load_subcorpus(corpus, tmp_path / "h.txt")
    assert list(subset.ids) == ids
    # By construction the initial retriever's top-5 over H_5 is its top-5 over the full corpus.
    full = evaluation.run_evaluation(dev, corpus, retriever, None, index=index, k=5).metrics
    hard = evaluation.run_evaluation(dev, subset, retriever, None, k=5).metrics
    for key in ("recall@1", "recall@5", "gold_recall@1", "gold_recall@5"):
        assert hard[key] == pytest.approx(full[key]), key


def test_load_subcorpus_errors_name_the_line(world_and_minilm, tmp_path):
    _, corpus, _, _, _ = world_and_minilm
    bad = tmp_path / "ids.txt"
    bad.write_text("tw0000001\nnope\n")
    with pytest.raises(ValueError, match=r"ids\.txt:2: passage id 'nope' is not in"):
        load_subcorpus(corpus, bad)
    bad.write_text("tw0000001\ntw0000002\ntw0000001\n")
    with pytest.raises(ValueError, match=r"ids\.txt:3: passage id 'tw0000001' repeats line 1"):
        load_subcorpus(corpus, bad)


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(
        {"spearman": 1.0, "kendall": 1.0}
    )
    assert rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx({"spearman": -1.0, "kendall": -1.0})
    assert math.isnan(rank_correlation([1, 2, 3], [5, 5, 5])["spearman"])
    with pytest.raises(ValueError, match="two equally long series"):
        rank_correlation([1], [1])


@pytest.mark.slow
def test_track_checkpoints_and_script(world_and_minilm, tmp_path, capsys):
    paths, corpus, dev, retriever, _ = world_and_minilm
    # Two checkpoints: the pretrained query tower and a noisy copy of it.
    clean = {k: v.clone() for k, v in retriever.query_tower.state_dict().items()}
    ckpts = []
    for i, noise in enumerate((0.0, 0.1)):
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in retriever.query_tower.parameters():
                p.add_(noise * torch.randn(p.shape, generator=generator))
        retriever.save_pretrained(tmp_path / f"ckpt{i}" / "retriever")
        retriever.query_tower.load_state_dict(clean)
        ckpts.append(tmp_path / f"ckpt{i}")
    ids_path = tmp_path / "h.txt"
    save_subcorpus_ids(build_hard_subcorpus(corpus, dev, retriever, k=5), ids_path)
    subset = load_subcorpus(corpus, ids_path)
    report = track_checkpoints(ckpts, dev, corpus, subset, retrieval_only=True, k=20)
    assert [r["checkpoint"] for r in report["checkpoints"]] == [str(c) for c in ckpts]
    assert set(report["correlation"]) >= {"recall@1", "gold_recall@5"}
    assert report["subcorpus_size"] == len(subset) and report["corpus_size"] == 200
    full = [r["full"]["gold_recall@1"] for r in report["checkpoints"]]
    assert full[0] > full[1]  # the noisy query tower retrieves worse

    script = load_script("track_hard_subcorpus")
    out = tmp_path / "track"
    argv = ["--data-path", str(paths.root), "--subcorpus", str(ids_path), "--retrieval-only", "--k", "20"]
    assert script.main([*argv, "--checkpoints", *map(str, ckpts), "--out", str(out)]) == 0
    saved = json.loads((out / "tracking.json").read_text())
    assert len(saved["checkpoints"]) == 2 and "| gold_recall@1 |" in capsys.readouterr().out
