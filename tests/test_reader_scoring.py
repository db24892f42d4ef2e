"""score_passages: log P(answer | question, passage alone) for every retrieved passage."""

import math

import pytest
import torch

from rlm.reader.fid import FiDReader
from rlm.reader.scoring import answer_token_log_probs, score_passages
from rlm.reader.small_t5 import SmallT5Config
from rlm.reader.tokenizer import train_tokenizer

TINY = SmallT5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4)
CORPUS = [
    "Alice Moreau was born in Lyon and works as a painter.",
    "Bob Tanaka was born in Osaka; he is a chemist. Osaka is a port city in Japan.",
] * 20
QUESTIONS = ["where was Alice born?", "what is Bob?", "who painted it?"]
PASSAGES = [
    [
        ("Alice", "Alice Moreau was born in Lyon."),
        ("Lyon", "Lyon lies on the Rhone."),
        ("Bob", "Bob is a chemist."),
    ],
    [("Bob", "Bob Tanaka was born in Osaka; he is a chemist and a very long winded man of Japan.")],
    [],
]
ANSWERS = ["Lyon", "a chemist", "Alice Moreau"]


@pytest.fixture(scope="module")
def reader():
    tok = train_tokenizer(CORPUS, vocab_size=400, min_frequency=1)
    return FiDReader.from_config(tok, TINY, seed=0)


def single_pair_log_likelihood(reader, question, passage, answer):
    """The reference: a K=1 FiD pass over one pair, its own padding, summed answer log-probabilities."""
    batch = reader.collator([question], [[passage]], [answer])
    with torch.no_grad():
        logits = reader.eval()(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]).logits
    return answer_token_log_probs(logits, batch["labels"]).sum().item(), int((batch["labels"] != -100).sum())


def test_scores_equal_a_loop_over_single_passages(reader):
    scores = score_passages(reader, QUESTIONS, PASSAGES, ANSWERS)
    assert scores.shape == (3, 3) and scores.dtype == torch.float32
    for b, plist in enumerate(PASSAGES):
        for k in range(3):
            if k < len(plist):
                expected, _ = single_pair_log_likelihood(reader, QUESTIONS[b], plist[k], ANSWERS[b])
                assert scores[b, k].item() == pytest.approx(expected, abs=1e-4)
                assert scores[b, k] < 0
            else:
                assert scores[b, k] == -math.inf


def test_chunking_mean_reduction_and_mode_restored(reader):
    reader.train()
    full = score_passages(reader, QUESTIONS, PASSAGES, ANSWERS)
    assert reader.training  # dropout was off while scoring, and training mode is back
    chunked = score_passages(reader, QUESTIONS, PASSAGES, ANSWERS, batch_size=2)
    assert torch.allclose(full, chunked, atol=1e-4)

    mean = score_passages(reader, QUESTIONS, PASSAGES, ANSWERS, reduction="mean")
    _, n_tokens = single_pair_log_likelihood(reader, QUESTIONS[1], PASSAGES[1][0], ANSWERS[1])
    assert mean[1, 0].item() == pytest.approx(full[1, 0].item() / n_tokens, abs=1e-5)
    assert n_tokens > 1


@pytest.mark.learning
def test_scores_follow_what_the_reader_learned(reader):
    """Trained to answer one question from whichever passage it gets, the reader ranks the gold passage first."""
    facts = [("Alice", "Lyon"), ("Bob", "Osaka"), ("Carla", "Japan"), ("Dan", "Rhone")]
    passages = [[(name, f"{name} was born in {city}.")] for name, city in facts]
    question = "where was the person born?"
    learner = FiDReader.from_config(reader.tokenizer, TINY, seed=1, dropout_rate=0.0)
    opt = torch.optim.AdamW(learner.parameters(), lr=1e-2)
    batch = learner.collator([question] * 4, passages, [city for _, city in facts])
    for _ in range(40):
        learner(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    candidates = [passages[1][0], passages[0][0], passages[2][0]]
    scores = score_passages(learner, [question, question], [candidates, candidates], ["Lyon", "Japan"])
    assert scores.argmax(dim=1).tolist() == [1, 2]


def test_errors_and_empty_inputs(reader):
    with pytest.raises(ValueError, match="reduction"):
        score_passages(reader, QUESTIONS, PASSAGES, ANSWERS, reduction="max")
    with pytest.raises(ValueError, match="3 questions, 2 passage lists"):
        score_passages(reader, QUESTIONS, PASSAGES[:2], ANSWERS)
    assert score_passages(reader, ["q"], [[]], ["a"]).shape == (1, 0)


def test_a_ranked_template_scores_every_passage_as_rank_one():
    """Step 4's labels must not depend on the retriever's own order: with `{rank}` in the template, FiD reading
    sees each passage's place, but each passage scored alone reads as rank 1, so reordering the selection
    permutes its scores and changes none."""
    from rlm.reader.fid import FiDConfig
    from rlm.reader.formatting import RANKED_TEMPLATE

    tok = train_tokenizer(CORPUS + ["rank: 1 2 3"] * 5, vocab_size=400, min_frequency=1)
    ranked = FiDReader.from_config(tok, TINY, FiDConfig(template=RANKED_TEMPLATE), seed=0)
    forward = score_passages(ranked, QUESTIONS[:1], PASSAGES[:1], ANSWERS[:1])
    backward = score_passages(ranked, QUESTIONS[:1], [PASSAGES[0][::-1]], ANSWERS[:1])
    torch.testing.assert_close(forward.flip(-1), backward, rtol=1e-5, atol=1e-5)
    # ... while the FiD pass over all of them reads the order.
    batch = ranked.collator(QUESTIONS[:1], PASSAGES[:1], ANSWERS[:1])
    swapped = ranked.collator(QUESTIONS[:1], [PASSAGES[0][::-1]], ANSWERS[:1])
    assert not torch.equal(batch["input_ids"][0, 0], swapped["input_ids"][0, 2])


def test_scoring_inputs_cut_from_the_fid_collation_are_the_pairs_tokenized_one_by_one(reader):
    """The training step tokenizes a micro-batch's passages once for the scoring pass and the FiD reader: with a
    template that does not name `{rank}` and a passage for every question, the pairs cut from the FiD collation
    are the very tensors the scoring pass would tokenize, so the scores are the same to the last bit."""
    from rlm.reader.scoring import score_inputs, scoring_inputs, scoring_inputs_from_reader

    questions, passages, answers = QUESTIONS[:2], PASSAGES[:2], ANSWERS[:2]
    cut = scoring_inputs_from_reader(reader.collator(questions, passages, answers), passages)
    own = scoring_inputs(reader.collator, questions, passages, answers)
    assert cut.shape == own.shape and torch.equal(cut.rows, own.rows) and torch.equal(cut.cols, own.cols)
    assert cut.batch.keys() == own.batch.keys()
    assert all(torch.equal(cut.batch[key], own.batch[key]) for key in own.batch)
    assert torch.equal(score_inputs(reader, [cut]), score_passages(reader, questions, passages, answers))
    # A question without passages pads the FiD collation with its question alone: not cut from it.
    assert scoring_inputs_from_reader(reader.collator(QUESTIONS, PASSAGES, ANSWERS), PASSAGES) is None
