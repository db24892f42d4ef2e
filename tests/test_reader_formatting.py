"""FiD collation: templates, per-passage truncation, passage masks, closed book, answer labels."""

import pytest

from rlm.reader.formatting import FiDCollator
from rlm.reader.tokenizer import train_tokenizer

TEXTS = [
    "question: where was Alice born? title: Alice context: Alice Moreau was born in Lyon.",
    "Bob Tanaka was born in Osaka and is a chemist. The city of Lyon lies on the Rhone.",
] * 30


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, vocab_size=350, min_frequency=1)


def decode(tok, ids, mask):
    return tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=True).strip()


def test_shapes_masks_and_template(tok):
    coll = FiDCollator(tok, max_passage_length=64)
    batch = coll(
        ["where was Alice born?", "who is Bob?"],
        [[("Alice", "Alice was born in Lyon."), ("Lyon", "Lyon lies on the Rhone."), ("Bob", "Bob is a chemist.")],
         [("Bob", "Bob Tanaka is a chemist.")]],
        ["Lyon", "a chemist"],
    )  # fmt: skip
    ids, mask, pmask = batch["input_ids"], batch["attention_mask"], batch["passage_mask"]
    assert ids.shape[:2] == mask.shape[:2] == pmask.shape == (2, 3)
    assert pmask.tolist() == [[True, True, True], [True, False, False]]
    assert (
        decode(tok, ids[0, 1], mask[0, 1])
        == "question: where was Alice born? title: Lyon context: Lyon lies on the Rhone."
    )
    # Missing passages are fully masked and padded.
    assert mask[1, 1:].sum() == 0 and (ids[1, 1:] == tok.pad_token_id).all()
    # Every real passage ends with eos (the tokenizer's own post-processing).
    for b, k in [(0, 0), (0, 2), (1, 0)]:
        assert ids[b, k, mask[b, k].sum() - 1] == tok.eos_token_id


def test_per_passage_truncation_keeps_short_passages_whole(tok):
    coll = FiDCollator(tok, max_passage_length=20)
    long_text = " ".join(["Bob Tanaka was born in Osaka."] * 20)
    batch = coll(["who?"], [[("Bob", long_text), ("A", "Lyon.")]])
    mask = batch["attention_mask"][0]
    assert batch["input_ids"].shape[-1] == 20 and mask[0].sum() == 20
    assert batch["input_ids"][0, 0, 19] == tok.eos_token_id
    assert decode(tok, batch["input_ids"][0, 1], mask[1]) == "question: who? title: A context: Lyon."


def test_question_without_passages_reads_question_alone_and_closed_book(tok):
    coll = FiDCollator(tok)
    mixed = coll(["q one?", "q two?"], [[("T", "text a"), ("U", "text b")], []])
    assert mixed["passage_mask"].tolist() == [[True, True], [False, False]]
    assert decode(tok, mixed["input_ids"][1, 0], mixed["attention_mask"][1, 0]) == "question: q two?"
    assert mixed["attention_mask"][1, 1].sum() == 0

    closed = coll(["q one?", "q two?"], [[], []], ["a", "b"])
    assert closed["input_ids"].shape[:2] == (2, 1) and not closed["passage_mask"].any()
    assert decode(tok, closed["input_ids"][0, 0], closed["attention_mask"][0, 0]) == "question: q one?"


def test_labels_answer_plus_eos_padded_with_minus_100(tok):
    coll = FiDCollator(tok, max_answer_length=4)
    labels = coll(["q", "q"], [[], []], ["Lyon", "Bob Tanaka was born in Osaka"])["labels"]
    short = tok("Lyon", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert labels.shape == (2, 4)
    assert labels[0, : len(short)].tolist() == short and (labels[0, len(short) :] == -100).all()
    assert labels[1, -1] == tok.eos_token_id and (labels[1] != -100).all()


def test_custom_template_and_errors(tok):
    coll = FiDCollator(tok, template="Q: {question} P: {text}", question_template="Q: {question}")
    batch = coll(["who?"], [[("ignored title", "Bob.")]])
    assert decode(tok, batch["input_ids"][0, 0], batch["attention_mask"][0, 0]) == "Q: who? P: Bob."
    with pytest.raises(ValueError, match="lacks the field"):
        FiDCollator(tok, template="question: {question}")
    with pytest.raises(ValueError, match="2 questions but 1 passage lists"):
        coll(["a", "b"], [[]])
    with pytest.raises(ValueError, match="empty batch"):
        coll([], [])


def test_rank_template_gives_each_passage_its_place_and_bad_templates_are_refused(tok):
    from rlm.reader.errors import InputError
    from rlm.reader.formatting import RANKED_TEMPLATE

    coll = FiDCollator(tok, max_passage_length=64, template=RANKED_TEMPLATE)
    batch = coll(["who is Bob?"], [[("Alice", "Alice was born in Lyon."), ("Bob", "Bob is a chemist.")]])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert decode(tok, ids[0, 0], mask[0, 0]).startswith("question: who is Bob? rank: 1 title: Alice")
    assert decode(tok, ids[0, 1], mask[0, 1]).startswith("question: who is Bob? rank: 2 title: Bob")
    with pytest.raises(InputError, match="does not format"):
        FiDCollator(tok, template="question: {question} {score} context: {text}")
