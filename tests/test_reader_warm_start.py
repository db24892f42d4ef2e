"""A FiD reader over a warm-started encoder-decoder: pretrained MiniLM encoder layers, fresh small decoder."""

import pytest
import torch
from transformers import AutoModel, AutoModelForSeq2SeqLM

from rlm.reader.fid import FiDReader
from rlm.reader.scoring import score_passages
from rlm.reader.warm_start import WarmStartConfig, build_warm_started_encoder_decoder

QUESTIONS = ["where was alice born?", "what is bob?"]
PASSAGES = [
    [("Alice", "Alice Moreau was born in Lyon."), ("Bob", "Bob is a chemist.")],
    [("Bob", "Bob is a chemist.")],
]
ANSWERS = ["lyon", "a chemist"]


@pytest.fixture(scope="module")
def warm(minilm_path):
    model, tok = build_warm_started_encoder_decoder(
        minilm_path, WarmStartConfig(encoder_layers=2, decoder_layers=1, decoder_dropout=0.0), seed=0
    )
    return model, tok


def test_encoder_keeps_the_first_pretrained_layers(warm, minilm_path):
    model, tok = warm
    pretrained = AutoModel.from_pretrained(minilm_path)
    assert len(model.encoder.encoder.layer) == model.encoder.config.num_hidden_layers == 2
    ours = model.encoder.state_dict()
    for name, value in pretrained.state_dict().items():
        if name.startswith("encoder.layer.") and int(name.split(".")[2]) >= 2:
            assert name not in ours
        elif name in ours:
            assert torch.equal(ours[name], value), name
    assert torch.equal(model.decoder.get_input_embeddings().weight, pretrained.get_input_embeddings().weight)
    assert (model.config.decoder_start_token_id, model.config.eos_token_id) == (
        tok.cls_token_id,
        tok.sep_token_id,
    )
    with pytest.raises(ValueError, match="encoder_layers=9"):
        build_warm_started_encoder_decoder(minilm_path, WarmStartConfig(encoder_layers=9))


@pytest.mark.learning
def test_fid_over_warm_start_trains_scores_and_round_trips(warm, tmp_path):
    model, tok = warm
    reader = FiDReader(model, tok, gradient_checkpointing=False)
    batch = reader.collator(QUESTIONS, PASSAGES, ANSWERS)
    reader.eval()
    with torch.no_grad():
        together = reader(**batch).logits
        alone = reader(**reader.collator(QUESTIONS[1:], PASSAGES[1:], ANSWERS[1:])).logits
    assert torch.allclose(together[1, : alone.shape[1]], alone[0], atol=1e-5)

    reader.train()
    opt = torch.optim.AdamW(reader.parameters(), lr=1e-4)
    losses = []
    for _ in range(5):
        loss = reader(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]

    reader.eval().save_pretrained(tmp_path / "warm")
    loaded = FiDReader.from_pretrained(tmp_path / "warm").eval()
    with torch.no_grad():
        assert torch.equal(reader(**batch).logits, loaded(**batch).logits)
    assert torch.allclose(
        score_passages(reader, QUESTIONS, PASSAGES, ANSWERS),
        score_passages(loaded, QUESTIONS, PASSAGES, ANSWERS),
    )
    assert type(AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "warm")).__name__ == "EncoderDecoderModel"
