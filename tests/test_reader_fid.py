"""Fusion-in-Decoder: equivalence with plain T5, fusion, masking, generation, persistence, switches."""

import json

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, BertConfig, EncoderDecoderConfig, EncoderDecoderModel

from rlm.reader.fid import FiDConfig, FiDReader
from rlm.reader.small_t5 import SmallT5Config
from rlm.reader.tokenizer import load_tokenizer, train_tokenizer

TINY = SmallT5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4)
CORPUS = [
    "Alice Moreau was born in Lyon and works as a painter.",
    "Bob Tanaka was born in Osaka; he is a chemist.",
    "question: where was Alice born? title: Alice context: The city of Lyon lies on the Rhone.",
] * 20
QUESTIONS = ["where was Alice born?", "what is Bob?"]
PASSAGES = [
    [
        ("Alice", "Alice Moreau was born in Lyon."),
        ("Lyon", "Lyon lies on the Rhone."),
        ("Bob", "Bob is a chemist."),
    ],
    [("Bob", "Bob Tanaka was born in Osaka; he is a chemist.")],
]
ANSWERS = ["Lyon", "a chemist"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=400, min_frequency=1)


@pytest.fixture()
def reader(tok):
    return FiDReader.from_config(tok, TINY, seed=0).eval()


def logits_of(reader, questions, passages, answers):
    batch = reader.collator(questions, passages, answers)
    with torch.no_grad():
        return reader(**batch).logits


def test_k1_equals_plain_t5(reader):
    batch = reader.collator(QUESTIONS, [[p[0]] for p in PASSAGES], ANSWERS)
    with torch.no_grad():
        fid = reader(**batch)
        plain = reader.model(
            input_ids=batch["input_ids"][:, 0],
            attention_mask=batch["attention_mask"][:, 0],
            labels=batch["labels"],
        )
    assert fid.logits.shape == plain.logits.shape
    assert torch.allclose(fid.logits, plain.logits, atol=1e-5)
    assert torch.allclose(fid.loss, plain.loss, atol=1e-6)


def test_changing_one_passage_changes_the_answer_distribution(reader):
    base = logits_of(reader, QUESTIONS[:1], PASSAGES[:1], ANSWERS[:1])
    for j in range(3):
        changed = [list(PASSAGES[0])]
        changed[0][j] = ("Osaka", "Osaka is a port city in Japan.")
        assert not torch.allclose(base, logits_of(reader, QUESTIONS[:1], changed, ANSWERS[:1]), atol=1e-4), j


def test_masked_passages_change_nothing(reader):
    # Question 1 has one passage, padded to K=3 by question 0: same logits as when it is alone (K=1).
    together = logits_of(reader, QUESTIONS, PASSAGES, ANSWERS)
    alone = logits_of(reader, QUESTIONS[1:], PASSAGES[1:], ANSWERS[1:])
    length = alone.shape[1]
    assert torch.allclose(together[1, :length], alone[0], atol=1e-5)

    # Garbage token ids in masked slots are never read.
    batch = reader.collator(QUESTIONS, PASSAGES, ANSWERS)
    noisy = {k: v.clone() for k, v in batch.items()}
    noisy["input_ids"][1, 1:] = torch.randint(3, len(reader.tokenizer), noisy["input_ids"][1, 1:].shape)
    with torch.no_grad():
        assert torch.equal(reader(**batch).logits, reader(**noisy).logits)


def test_question_without_passages_in_a_k_gt_0_batch_equals_closed_book(reader):
    together = logits_of(reader, QUESTIONS, [PASSAGES[0], []], ANSWERS)
    closed = logits_of(reader, QUESTIONS[1:], [[]], ANSWERS[1:])
    assert torch.isfinite(together).all()
    assert torch.allclose(together[1, : closed.shape[1]], closed[0], atol=1e-5)


def test_generate_greedy_and_beam_batched_return_strings(reader):
    greedy = reader.answer(QUESTIONS, PASSAGES, max_new_tokens=4)
    beam = reader.answer(QUESTIONS, PASSAGES, max_new_tokens=4, num_beams=3)
    assert len(greedy) == len(beam) == 2 and all(isinstance(a, str) for a in greedy + beam)
    one_by_one = [reader.answer([q], [p], max_new_tokens=4)[0] for q, p in zip(QUESTIONS, PASSAGES)]
    assert greedy == one_by_one
    batch = reader.collator(QUESTIONS, PASSAGES)
    ids = reader.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=4)
    assert ids.dtype == torch.long and ids.shape[0] == 2 and ids.shape[1] <= 5
    assert (
        reader.answer(["where was Alice born?"], [[]], max_new_tokens=4)[0]
        == reader.answer(["where was Alice born?"], [[]], max_new_tokens=4, batch_size=1)[0]
    )


def test_answer_confidence_is_the_probability_of_the_generated_sequence(reader):
    """The confidence of each answer is exp(-teacher-forced NLL) of the tokens it generated (through EOS)."""
    got = reader.answer_with_confidence(QUESTIONS, PASSAGES, max_new_tokens=6)
    assert [a for a, _ in got] == reader.answer(QUESTIONS, PASSAGES, max_new_tokens=6)
    batch = reader.collator(QUESTIONS, PASSAGES)
    ids = reader.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=6)
    eos = reader.tokenizer.eos_token_id
    for b, (_, confidence) in enumerate(got):
        generated = ids[b, 1:].tolist()  # without the decoder start token
        if eos in generated:
            generated = generated[: generated.index(eos) + 1]
        one = reader.collator([QUESTIONS[b]], [PASSAGES[b]])
        with torch.no_grad():
            nll = reader(one["input_ids"], one["attention_mask"], labels=torch.tensor([generated])).loss
        assert confidence == pytest.approx(float(torch.exp(-nll * len(generated))), rel=1e-4)
    beams = reader.answer_with_confidence(QUESTIONS, PASSAGES, max_new_tokens=6, num_beams=3)
    assert all(0.0 < c <= 1.0 for _, c in beams)


@pytest.mark.learning
def test_reader_learns_to_answer_from_its_passages(tok):
    torch.manual_seed(0)
    reader = FiDReader.from_config(tok, TINY, seed=0, dropout_rate=0.0)
    batch = reader.collator(QUESTIONS, PASSAGES, ANSWERS)
    opt = torch.optim.AdamW(reader.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        loss = reader(**batch).loss
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert loss.item() < 0.1 * first
    assert reader.answer(QUESTIONS, PASSAGES) == ANSWERS
    # It has learnt these answers, and it is sure of them.
    assert all(c > 0.5 for _, c in reader.answer_with_confidence(QUESTIONS, PASSAGES))


def test_save_load_round_trip_and_plain_transformers_load(reader, tmp_path):
    reader.config = FiDConfig(max_passage_length=48, max_answer_length=8)
    reader.save_pretrained(tmp_path / "reader")
    files = {p.name for p in (tmp_path / "reader").iterdir()}
    assert {"model.safetensors", "config.json", "fid_config.json", "tokenizer.json"} <= files
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folder left behind

    loaded = FiDReader.from_pretrained(tmp_path / "reader").eval()
    assert loaded.config == reader.config
    assert torch.equal(
        logits_of(reader, QUESTIONS, PASSAGES, ANSWERS), logits_of(loaded, QUESTIONS, PASSAGES, ANSWERS)
    )
    assert loaded.answer(QUESTIONS, PASSAGES, max_new_tokens=4) == reader.answer(
        QUESTIONS, PASSAGES, max_new_tokens=4
    )

    plain = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "reader").eval()
    batch = reader.collator(QUESTIONS, [[p[0]] for p in PASSAGES], ANSWERS)
    with torch.no_grad():
        out = plain(
            input_ids=batch["input_ids"][:, 0],
            attention_mask=batch["attention_mask"][:, 0],
            labels=batch["labels"],
        )
        assert torch.allclose(out.logits, reader(**batch).logits, atol=1e-5)

    # Saving again over an existing folder replaces it; overrides win over fid_config.json.
    reader.save_pretrained(tmp_path / "reader")
    assert (
        FiDReader.from_pretrained(tmp_path / "reader", max_passage_length=64).config.max_passage_length == 64
    )
    with pytest.raises(ValueError, match=r"overrides: unknown key\(s\) \['max_len'\]"):
        FiDReader.from_pretrained(tmp_path / "reader", max_len=64)


def test_unknown_fid_config_key_is_refused(reader, tmp_path):
    reader.save_pretrained(tmp_path / "r")
    cfg = tmp_path / "r" / "fid_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "max_pasage_length": 3}))
    with pytest.raises(ValueError, match=r"fid_config.json: unknown key\(s\) \['max_pasage_length'\]"):
        FiDReader.from_pretrained(tmp_path / "r")


def test_gradient_checkpointing_gives_the_same_gradients(tok):
    grads = []
    for checkpointing in (False, True):
        reader = FiDReader.from_config(
            tok, TINY, seed=0, dropout_rate=0.0, gradient_checkpointing=checkpointing
        )
        reader.train()
        reader(**reader.collator(QUESTIONS, PASSAGES, ANSWERS)).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in reader.parameters() if p.grad is not None]))
    assert reader.is_gradient_checkpointing
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_bf16_autocast_on_cpu(tok):
    reader = FiDReader.from_config(tok, TINY, seed=0).eval()
    batch = reader.collator(QUESTIONS, PASSAGES, ANSWERS)
    with torch.no_grad():
        fp32 = reader(**batch).loss
        reader.bf16 = True
        bf16 = reader(**batch)
    assert bf16.logits.dtype == torch.bfloat16
    assert abs(bf16.loss.item() - fp32.item()) < 0.05 * fp32.item()
    assert len(reader.answer(QUESTIONS, PASSAGES, max_new_tokens=3)) == 2

    # With bf16 off, the reader leaves an autocast opened by the caller (e.g. accelerate) in force.
    reader.bf16 = False
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert reader(**batch).logits.dtype == torch.bfloat16
    with torch.no_grad():
        assert reader(**batch).logits.dtype == torch.float32


def test_any_hf_encoder_decoder_works(minilm_path):
    """A BERT-style EncoderDecoderModel with the packaged WordPiece tokenizer (the warm-start layout)."""
    tok = load_tokenizer(minilm_path)
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64}
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(vocab_size=len(tok), **small), BertConfig(vocab_size=len(tok), **small)
    )
    config.decoder_start_token_id = tok.cls_token_id
    config.pad_token_id = tok.pad_token_id
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model = EncoderDecoderModel(config=config)
    model.generation_config.update(
        decoder_start_token_id=tok.cls_token_id, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    reader = FiDReader(model, tok).eval()
    batch = reader.collator(QUESTIONS, PASSAGES, ANSWERS)
    with torch.no_grad():
        out = reader(**batch)
    assert torch.isfinite(out.loss)
    together = out.logits
    alone = logits_of(reader, QUESTIONS[1:], PASSAGES[1:], ANSWERS[1:])
    assert torch.allclose(together[1, : alone.shape[1]], alone[0], atol=1e-5)
    assert all(isinstance(a, str) for a in reader.answer(QUESTIONS, PASSAGES, max_new_tokens=3, num_beams=2))


def test_refuses_decoder_only_models(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="encoder-decoder"):
        FiDReader(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok))), tok)
