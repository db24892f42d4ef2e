"""rlm.base.evalmode.eval_mode: eval inside the block, the module's own mode after it, also when the block raises."""

from __future__ import annotations

import pytest
import torch

from rlm.base.evalmode import eval_mode


def test_eval_inside_and_the_earlier_mode_after_even_on_error():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    with eval_mode(module) as inside:
        assert inside is module and not module.training and not module[1].training
    assert module.training and module[1].training
    with pytest.raises(RuntimeError, match="boom"), eval_mode(module):
        raise RuntimeError("boom")
    assert module.training and module[1].training
    module.eval()
    with eval_mode(module):
        pass
    assert not module.training  # a module that was in eval mode stays there


def test_encoding_building_answering_and_scoring_hand_the_module_back_in_train_mode_after_an_error(
    monkeypatch, tmp_path
):
    """The four places that switch a model to eval mode (encode, buffer build, answer, score) restore train mode
    even when the work inside fails."""
    from tiny_run import tiny_retriever

    from rlm.reader.fid import FiDReader
    from rlm.reader.scoring import score_passages
    from rlm.reader.small_t5 import SmallT5Config
    from rlm.reader.tokenizer import train_tokenizer
    from rlm.retriever.buffer import build_passage_buffer
    from rlm.retriever.encoder import SentenceEncoder

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    encoder = SentenceEncoder.from_pretrained(str(tiny_retriever(tmp_path / "tiny"))).train()
    monkeypatch.setattr(encoder, "forward", fail)  # what both encode and the buffer build call
    for call in (
        lambda: encoder.encode(["Lyon is a city."]),
        lambda: build_passage_buffer(
            ["p0"], ["Lyon is a city."], encoder, tmp_path / "b", show_progress=False
        ),
    ):
        with pytest.raises(RuntimeError, match="boom"):
            call()
        assert encoder.training

    tokenizer = train_tokenizer(
        ["Lyon is a city.", "where was Ada born?"] * 10, vocab_size=300, min_frequency=1
    )
    reader = FiDReader.from_config(tokenizer, SmallT5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2))
    reader.train()
    monkeypatch.setattr(reader, "generate", fail)
    monkeypatch.setattr(reader, "forward", fail)
    for call in (
        lambda: reader.answer(["where was Ada born?"], [[("Ada", "Lyon is a city.")]]),
        lambda: score_passages(reader, ["where was Ada born?"], [[("Ada", "Lyon is a city.")]], ["Lyon"]),
    ):
        with pytest.raises(RuntimeError, match="boom"):
            call()
        assert reader.training
