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


@pytest.mark.parametrize(
    "name, lines, fmt, bad_line",
    [
        ("c.jsonl", [b'{"id": "a", "text": "x"}', b'{"id": "b", "text": "caf\xe9"}'], None, 2),
        ("c.jsonl", [b'{"id": "a", "text": "caf\xe9"}'], None, 1),  # the line that tells the format
        ("c.jsonl", [b'{"id": "0", "contents": "T\\nx"}', b'{"id": "1", "contents": "\xe9"}'], None, 2),
        ("c.tsv", [b"id\ttext\ttitle", b"1\tx\tX", b"2\ty\tCaf\xe9"], None, 3),
        ("c.txt", [b'{"id": "a", "text": "x"}', b'{"id": "b", "text": "\xff"}'], "jsonl", 2),
    ],
)
def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path, name, lines, fmt, bad_line):
    """A Latin-1 corpus is the user's data to convert: one line naming where, not a UnicodeDecodeError."""
    from rlm.errors import UserError

    path = tmp_path / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    with pytest.raises(UserError, match=rf"{name}:{bad_line}: not UTF-8 \(byte 0x(e9|ff) at offset \d+"):
        load_corpus(path, fmt=fmt)


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


def _dpr_lines(n):
    return ["id\ttext\ttitle"] + [f"{i}\tText number {i} about things.\tTitle {i}" for i in range(n)]


def test_fingerprint_is_the_file_sha256_from_the_scan(tmp_path):
    import hashlib
    import shutil

    path = _write(tmp_path / "a.tsv", _dpr_lines(50))
    corpus = load_corpus(path)
    assert corpus.fingerprint == "dpr_tsv:sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    shutil.copy(path, tmp_path / "b.tsv")  # the same bytes elsewhere are the same corpus
    assert load_corpus(tmp_path / "b.tsv").fingerprint == corpus.fingerprint
    data = bytearray(path.read_bytes())
    data[data.index(b"number 7") + 7] = ord("8")  # one byte of one text, same length
    (tmp_path / "c.tsv").write_bytes(bytes(data))
    assert load_corpus(tmp_path / "c.tsv").fingerprint != corpus.fingerprint
    # The same bytes read as another format are other passages, so another fingerprint.
    both = _write(tmp_path / "d.jsonl", [json.dumps({"id": "a", "text": "x", "contents": "T\nx"})])
    assert load_corpus(both, fmt="jsonl").fingerprint != load_corpus(both, fmt="pyserini").fingerprint


def test_ids_are_one_blob_not_a_list(tmp_path):
    from rlm.retriever.ids import IdSequence

    corpus = load_corpus(_write(tmp_path / "a.tsv", _dpr_lines(5)))
    assert isinstance(corpus.ids, IdSequence) and corpus.ids.to_bytes() == b"0\n1\n2\n3\n4\n"
    assert list(corpus.ids) == ["0", "1", "2", "3", "4"] and corpus.ids == ["0", "1", "2", "3", "4"]
    assert corpus.ids[-1] == "4" and corpus.ids[1:3] == ["1", "2"]
    with pytest.raises(IndexError):
        corpus.ids[5]


def test_fingerprint_cache_hits_until_size_or_mtime_changes(tmp_path, hashed_files):
    import os

    hashed = hashed_files
    path, cache = _write(tmp_path / "a.tsv", _dpr_lines(20)), tmp_path / "ckpt" / "fp.json"
    first = load_corpus(path, fingerprint_cache=cache)
    assert len(hashed) == 1 and cache.is_file()
    again = load_corpus(path, fingerprint_cache=cache)
    assert len(hashed) == 1, "an unchanged file must not be hashed again"
    assert again.fingerprint == first.fingerprint and again.ids == first.ids and again[3] == first[3]
    # A newer mtime (same size, same bytes) is a miss: the file is hashed again and the entry replaced.
    stamp = path.stat().st_mtime_ns
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    assert load_corpus(path, fingerprint_cache=cache).fingerprint == first.fingerprint and len(hashed) == 2
    assert load_corpus(path, fingerprint_cache=cache).fingerprint == first.fingerprint and len(hashed) == 2
    # Another size is a miss too, and gives the new file's fingerprint.
    _write(path, _dpr_lines(21))
    assert load_corpus(path, fingerprint_cache=cache).fingerprint == load_corpus(path).fingerprint
    # The cache is keyed by the path: a second corpus gets its own entry.
    other = _write(tmp_path / "b.tsv", _dpr_lines(3))
    load_corpus(other, fingerprint_cache=cache)
    assert len(json.loads(cache.read_text())["corpora"]) == 2


def test_fingerprint_cache_entry_is_trusted_only_for_its_stamp(tmp_path):
    path, cache = _write(tmp_path / "a.tsv", _dpr_lines(4)), tmp_path / "fp.json"
    real = load_corpus(path, fingerprint_cache=cache).fingerprint
    entries = json.loads(cache.read_text())
    (entry,) = entries["corpora"].values()
    entry["fingerprint"] = "planted"
    cache.write_text(json.dumps(entries))
    assert load_corpus(path, fingerprint_cache=cache).fingerprint == "planted"  # a hit: no hashing at all
    assert load_corpus(path, fmt="dpr_tsv", fingerprint_cache=cache).fingerprint == "planted"
    entry["size"] += 1
    cache.write_text(json.dumps(entries))
    assert load_corpus(path, fingerprint_cache=cache).fingerprint == real
    cache.write_text("not json")  # a broken cache is rebuilt, never an error
    assert load_corpus(path, fingerprint_cache=cache).fingerprint == real


def _edit_in_place(path, old: bytes, new: bytes) -> None:
    """Replace `old` by `new` (same length) in `path` and give it back its mtime, as `touch -d` or `rsync -t`
    can: only the file's ctime and bytes tell the edit."""
    import os

    assert len(old) == len(new)
    before = path.stat()
    path.write_bytes(path.read_bytes().replace(old, new, 1))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_the_fingerprint_cache_notices_an_edit_that_keeps_the_size_and_the_mtime(tmp_path):
    from rlm.data.corpus import _file_stamp

    path, cache = _write(tmp_path / "a.tsv", _dpr_lines(20_000)), tmp_path / "fp.json"
    first, sampled = load_corpus(path, fingerprint_cache=cache), _file_stamp(path)["sampled_blake2b"]
    _edit_in_place(path, b"Text number 10000 about", b"Text number 10000 ABOUT")
    assert _file_stamp(path)["sampled_blake2b"] == sampled  # between the sampled blocks: the ctime tells
    edited = load_corpus(path, fingerprint_cache=cache)
    assert edited.fingerprint == load_corpus(path).fingerprint != first.fingerprint
    assert edited[10000].text == "Text number 10000 ABOUT things."


def test_the_fingerprint_cache_notices_an_edit_in_a_sampled_block_where_the_ctime_stays(tmp_path):
    """Where a file system keeps no ctime (some network and FUSE ones), the hash of the sampled blocks still
    tells an edit of the file's first block (every sample starts there)."""
    path, cache = _write(tmp_path / "a.tsv", _dpr_lines(2000)), tmp_path / "fp.json"
    first = load_corpus(path, fingerprint_cache=cache)
    _edit_in_place(path, b"Text number 3 about", b"Text number 3 ABOUT")
    entries = json.loads(cache.read_text())
    (entry,) = entries["corpora"].values()
    entry["ctime_ns"] = path.stat().st_ctime_ns  # as if the edit had left the ctime as it was
    cache.write_text(json.dumps(entries))
    assert (
        load_corpus(path, fingerprint_cache=cache).fingerprint
        == load_corpus(path).fingerprint
        != first.fingerprint
    )


def test_subset_fingerprint_follows_its_rows_and_corpus(shared_data, tmp_path):
    corpus = load_corpus(shared_data / "wiki_sample" / "passages.jsonl")
    a = CorpusSubset(corpus, [10, 3, 500])
    assert a.fingerprint == CorpusSubset(corpus, [10, 3, 500]).fingerprint
    assert a.fingerprint != CorpusSubset(corpus, [3, 10, 500]).fingerprint
    assert a.fingerprint != CorpusSubset(corpus, [10, 3]).fingerprint
    other = load_corpus(
        _write(tmp_path / "o.jsonl", [json.dumps({"id": str(i), "text": "x"}) for i in range(600)])
    )
    assert a.fingerprint != CorpusSubset(other, [10, 3, 500]).fingerprint


def test_a_cached_corpus_opens_without_parsing_a_line_and_reads_the_same(tmp_path, monkeypatch):
    """The fingerprint cache keeps the scan's arrays beside it: the next open of the unchanged file parses no
    line (21M DPR passages: ~2 minutes of a demo's start-up) and reads, finds and refuses as the first did.
    A scan file that is not the one the entry recorded (rewritten, torn) is ignored and the file scanned."""
    import rlm.data.corpus as corpus_module

    path, cache = _write(tmp_path / "a.tsv", _dpr_lines(30)), tmp_path / "ckpt" / "fp.json"
    first = load_corpus(path, fingerprint_cache=cache)
    (scan_file,) = cache.parent.glob("fp.*.scan.npz")
    parsed = []
    parse = corpus_module._PARSERS["dpr_tsv"]
    monkeypatch.setitem(corpus_module._PARSERS, "dpr_tsv", lambda *a: parsed.append(a[1]) or parse(*a))
    again = load_corpus(path, fingerprint_cache=cache)
    assert parsed == [] and len(again) == len(first) == 30
    assert again.ids == first.ids and again.fingerprint == first.fingerprint
    assert again[7] == first[7] and again.index_of(first.ids[12]) == 12 and parsed == [7 + 2]  # a line read
    with pytest.raises(KeyError):
        again.index_of("no such id")
    scan_file.write_bytes(scan_file.read_bytes()[:100])  # torn: another size than the entry recorded
    parsed.clear()
    third = load_corpus(path, fingerprint_cache=cache)
    assert len(parsed) == 30 and third.ids == first.ids
    parsed.clear()
    assert (
        load_corpus(path, fingerprint_cache=cache).ids == first.ids and parsed == []
    )  # the scan was rewritten
