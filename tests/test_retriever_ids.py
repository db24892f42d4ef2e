"""IdSequence: passage ids as one blob + offsets, read and written in the ids.txt format."""

from __future__ import annotations

import pytest

from rlm.retriever.ids import IdSequence, first_mismatch, id_lines


@pytest.mark.parametrize("text", ["a\nb\nc", "a\nb\nc\n", "", "\n", "é\n\nx", "only"])
def test_from_lines_reads_like_split(text):
    expected = text.split("\n")
    ids = IdSequence.from_lines(text.encode())
    assert list(ids) == expected and len(ids) == len(expected)
    for count in range(len(expected) + 1):
        assert list(IdSequence.from_lines(text.encode(), count)) == expected[:count]
    with pytest.raises(ValueError, match=f"{len(expected)} ids, expected {len(expected) + 1}"):
        IdSequence.from_lines(text.encode(), len(expected) + 1)


def test_round_trip_equality_and_lookups():
    strings = [f"doc{i}" for i in range(200_000)] + ["ünï"]
    ids = IdSequence.from_strings(strings)
    assert ids == strings and strings == ids and ids[-1] == "ünï" and ids[5] == "doc5"
    assert IdSequence.from_lines(id_lines(ids)) == ids
    assert id_lines(ids) == "\n".join(strings).encode() == id_lines(strings)
    assert first_mismatch(ids, IdSequence.from_strings(strings)) is None
    assert first_mismatch(ids, IdSequence.from_strings(strings[:7] + ["x"] + strings[8:])) == 7
    assert ids != strings[:-1] and ids != ["x"] * len(strings)
    assert ids.nbytes() < 4_000_000  # a list of these str would take ~15 MB


def test_an_id_with_a_line_break_is_refused_when_written():
    for ids in (IdSequence.from_strings(["a", "b\nc"]), ["a", "b\rc"]):
        with pytest.raises(ValueError, match="row 1 contains a line break"):
            id_lines(ids)
    odd = IdSequence.from_strings(["a", "b\nc", "d"])
    assert list(odd) == ["a", "b\nc", "d"]  # held exactly all the same


def test_joined_and_head_keep_every_id_as_one_blob():
    """What corpus updates build an index's and an edition's ids with: parts one after another (lists and
    IdSequences alike, an empty part skipped), and the base rows back as an IdSequence."""
    base = IdSequence.from_strings(["a", "b", ""])
    joined = IdSequence.joined([base, [], ["c", "d"], IdSequence.from_strings(["e"])])
    assert list(joined) == ["a", "b", "", "c", "d", "e"] and isinstance(joined, IdSequence)
    assert joined.head(3) == base and list(joined.head(0)) == []
    assert list(IdSequence.joined([])) == []
