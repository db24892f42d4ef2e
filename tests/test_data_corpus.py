import json
import pickle

import numpy as np
import pytest
import torch

from rlm.data.corpus import CorpusSubset, Passage, detect_format, load_corpus


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_wiki_sample_pyserini_layout(shared_data):
    corpus = load_corpus(shared_data / "wiki_sample" / "passages.jsonl")
    assert corpus.fmt == "pyserini"
    assert len(corpus) == 1000
    first = corpus[0]
    assert first.id == "0" and first.title == "Evan Morris"  # DPR's quotes around the title are dropped
    assert first.text.startswith("Evan Morris Evan L. Morris")
    assert corpus.retrieval_texts()[0] == f"Evan Morris. {first.text}"
    assert corpus.index_of("999") == 999 and corpus[-1].id == "999"
    assert corpus[np.int64(5)] == corpus[torch.tensor(5)] == corpus[5]
    assert corpus.ids[np.int64(7)] == "7"
    assert [p.id for p in corpus][:3] == ["0", "1", "2"]


def test_multihop200_jsonl_corpus(shared_data):
    corpus = load_corpus(shared_data / "multihop200" / "corpus.jsonl")
    assert corpus.fmt == "jsonl" and len(corpus) == 2884
    row = corpus.index_of("musique_994")
    assert corpus[row].id == "musique_994" and corpus.ids[row] == "musique_994"
    with pytest.raises(KeyError, match="nope"):
        corpus.index_of("nope")


def test_dpr_tsv_with_header_quotes_and_blank_lines(tmp_path):
    path = _write(
        tmp_path / "psgs.tsv",
        [
            "id\ttext\ttitle",
            '1\t"Aaron is a ""prophet"" in the Bible."\tAaron',
            "",
            "2\tPlain text.\tBeta",
            '3\t"A quoted\ttab."\t"""Q"" title"',
        ],
    )
    corpus = load_corpus(path)
    assert corpus.fmt == "dpr_tsv" and len(corpus) == 3
    assert corpus[0] == Passage("1", "Aaron", 'Aaron is a "prophet" in the Bible.')
    assert corpus[1] == Passage("2", "Beta", "Plain text.")
    assert corpus.index_of("2") == 1
    assert corpus[2] == Passage("3", '"Q" title', "A quoted\ttab.")


def test_corpus_survives_pickling_for_workers(tmp_path):
    path = _write(
        tmp_path / "c.jsonl", [json.dumps({"id": f"p{i}", "title": "", "text": f"t{i}"}) for i in range(5)]
    )
    corpus = load_corpus(path)
    assert corpus[2].text == "t2"
    clone = pickle.loads(pickle.dumps(corpus))
    assert clone[4] == Passage("p4", "", "t4") and clone.retrieval_texts()[4] == "t4"


def test_duplicate_ids_name_both_lines(tmp_path):
    lines = [json.dumps({"id": i, "title": "T", "text": "x"}) for i in ("a", "b", "c", "b")]
    with pytest.raises(ValueError, match=r"duplicate passage id 'b' on lines 2 and 4"):
        load_corpus(_write(tmp_path / "c.jsonl", lines))
    with pytest.raises(ValueError, match=r"duplicate passage id '7' on lines 2 and 3"):
        load_corpus(_write(tmp_path / "c.tsv", ["id\ttext\ttitle", "7\ta\tA", "7\tb\tB"]))


@pytest.mark.parametrize(
    "lines, fmt, message",
    [
        (['{"id": "a", "text": "x"}', '{"id": "b", "text": '], "jsonl", r"c\.txt:2: malformed JSON"),
        (['{"id": "a", "text": "x"}', '{"id": "b"}'], "jsonl", r"c\.txt:2: missing key\(s\) \['text'\]"),
        (['{"id": "a", "text": "x"}', "[1, 2]"], "jsonl", r"c\.txt:2: expected a JSON object"),
        (
            ['{"id": "0", "contents": "t\\nx"}', '{"id": "1"}'],
            "pyserini",
            r"c\.txt:2: a pyserini corpus line",
        ),
        (
            ["id\ttext\ttitle", "1\tx\tX", "2\tonly two"],
            "dpr_tsv",
            r"c\.txt:3: a DPR TSV line .* got 2 field",
        ),
        (["id\ttext\ttitle", "\tx\tX"], "dpr_tsv", r"c\.txt:2: a DPR TSV line"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, lines, fmt, message):
    with pytest.raises(ValueError, match=message):
        load_corpus(_write(tmp_path / "c.txt", lines), fmt=fmt)


def test_format_detection_errors(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        detect_format(_write(tmp_path / "e.jsonl", []))
    with pytest.raises(ValueError, match="cannot tell the corpus format"):
        detect_format(_write(tmp_path / "x.jsonl", ['{"question": "q"}']))
    with pytest.raises(ValueError, match="unknown corpus format"):
        load_corpus(_write(tmp_path / "y.jsonl", ['{"id": 1, "text": "x"}']), fmt="csv")
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        load_corpus(tmp_path / "missing.jsonl")


def test_subset_keeps_corpus_interface(shared_data):
    corpus = load_corpus(shared_data / "wiki_sample" / "passages.jsonl")
    subset = CorpusSubset(corpus, [10, 3, 500])
    assert len(subset) == 3 and list(subset.ids) == ["10", "3", "500"]
    assert subset[1] == corpus[3] and subset.index_of("500") == 2
    assert subset.retrieval_texts()[0] == corpus.retrieval_texts()[10]
