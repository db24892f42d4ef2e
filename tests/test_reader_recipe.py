"""The quickstart's reader recipe: the warm-started reader built from config, and the reader-only warm-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_overrides

from rlm.components import build_components, build_reader
from rlm.config import load_config
from rlm.data.qa import QAExample
from rlm.reader.fid import FiDReader
from rlm.training.loop import train
from rlm.training.model import RetrievalAugmentedModel
from rlm.training.schedule import check_gold_passages, make_batch, reader_only_step
from rlm.training.strategies import make_strategy

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WARM = [
    "reader.arch=warm_start",
    "reader.warm_start.layers=1",
    "reader.num_decoder_layers=1",
    "reader.num_heads=2",
    "reader.d_ff=64",
    "reader.max_passage_length=40",
    "reader.max_answer_length=8",
]
QUESTIONS = ["Where was Talia Vorne born?", "What is the occupation of Brus Kelan?"]
PASSAGES = [
    [
        ("Talia Vorne", "Talia Vorne is a native of Grewick."),
        ("Talia Vorna", "Talia Vorna was born in Muholm."),
    ],
    [("Brus Kelan", "By profession, Brus Kelan is a baker.")],
]
ANSWERS = ["Grewick", "baker"]


def tiny_world_overrides(root: Path, world: Path) -> list[str]:
    """The tiny run over the session's `tiny_world` (tests/conftest.py), writing to root/run."""
    return tiny_overrides(world, root / "run", "cpu=true")


@pytest.mark.parametrize(
    "override, message",
    [
        ("reader.arch=bart", "reader.arch must be one of"),
        ("reader.warm_start.layers=0", "reader.warm_start.layers must be >= 1"),
        ("schedule.reader_only_steps=-1", "schedule.reader_only_steps must be >= 0"),
        ("schedule.gold_passage_steps=-1", "schedule.gold_passage_steps must be >= 0"),
        ("schedule.final_reader_only_steps=-1", "schedule.final_reader_only_steps must be >= 0"),
    ],
)
def test_reader_recipe_keys_are_validated(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_quickstart_uses_the_recipe():
    cfg = load_config(CONFIGS / "quickstart.yaml")
    assert cfg.algorithm == 2 and cfg.strategy.name == "corrector"
    assert (
        cfg.reader.arch == "t5" and cfg.reader.num_passages >= 4 and cfg.strategy.k >= cfg.reader.num_passages
    )
    # Copy first (the gold passage alone), then Algorithm 2 proper right after, then the reader alone on the
    # trained retriever's selection; the reader reads each passage's rank.
    rc = cfg.schedule
    assert (
        0 < rc.gold_passage_steps == rc.reader_only_steps < cfg.optim.max_steps - rc.final_reader_only_steps
    )
    joint = [s for s in range(cfg.optim.max_steps) if not reader_only_step(cfg, s)]
    assert joint == list(range(rc.reader_only_steps, cfg.optim.max_steps - rc.final_reader_only_steps))
    assert rc.final_reader_only_steps > 0 and "{rank}" in cfg.reader.template


@pytest.mark.learning
def test_warm_started_reader_from_config_is_small_to_train_and_round_trips(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", *WARM])
    reader = build_reader(cfg, corpus=None, examples=[])
    model = reader.model
    assert len(model.encoder.encoder.layer) == 1 and len(model.decoder.bert.encoder.layer) == 1
    # Frozen pretrained token embeddings, the decoder's output layer tied to its (frozen) copy of them.
    decoder_embeddings = model.decoder.get_input_embeddings().weight
    assert model.decoder.get_output_embeddings().weight is decoder_embeddings
    assert not decoder_embeddings.requires_grad
    assert not model.encoder.get_input_embeddings().weight.requires_grad
    trainable = sum(p.numel() for p in reader.parameters() if p.requires_grad)
    assert trainable < 0.25 * sum(p.numel() for p in reader.parameters())
    # The same seed builds the same reader (a resumed run rebuilds it before loading its checkpoint).
    again = build_reader(cfg, corpus=None, examples=[])
    assert all(torch.equal(a, b) for a, b in zip(reader.parameters(), again.parameters()))

    batch = reader.collator(QUESTIONS, PASSAGES, ANSWERS)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    frozen_before = decoder_embeddings.detach().clone()
    opt = torch.optim.AdamW([p for p in reader.parameters() if p.requires_grad], lr=1e-3)
    reader.train()
    losses = []
    for _ in range(8):
        loss = reader(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]
    assert torch.equal(decoder_embeddings, frozen_before)

    reader.save_pretrained(tmp_path / "reader")
    loaded = FiDReader.from_pretrained(tmp_path / "reader")
    reader.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.allclose(reader(**inputs).logits, loaded(**inputs).logits, atol=1e-5)


def test_unfrozen_warm_start_trains_its_embeddings(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", *WARM, "reader.warm_start.freeze_embeddings=false"])
    reader = build_reader(cfg, corpus=None, examples=[])
    assert reader.model.encoder.get_input_embeddings().weight.requires_grad
    assert reader.model.decoder.get_output_embeddings().weight.requires_grad


def test_reader_only_step_moves_the_reader_alone(tmp_path, tiny_world):
    cfg = load_config(None, tiny_world_overrides(tmp_path, tiny_world) + WARM)
    parts = build_components(cfg)
    model = RetrievalAugmentedModel(parts.retriever, parts.reader, parts.corrector, parts.collator, cfg)
    strategy = make_strategy(cfg.strategy, parts.buffer, cfg.optim.max_steps, seed=0)
    model.parameter_groups(strategy, cfg.optim)
    batch = make_batch(parts.train_examples, [0, 1], parts.corpus, cfg.algorithm)

    warm_up = model(batch, strategy, parts.corpus, reader_only=True)
    assert set(warm_up.terms) == {"reader"} and "retriever_loss" not in warm_up.metrics
    warm_up.loss.backward()
    assert all(p.grad is None for p in model.retriever.parameters())
    assert all(p.grad is None for p in model.corrector.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.reader.parameters())

    joint = model(batch, strategy, parts.corpus)
    assert set(joint.terms) == {"reader", "retriever", "corrector"}


def test_gold_passage_batch_reads_the_gold_passages_alone(tmp_path, tiny_world):
    cfg = load_config(None, tiny_world_overrides(tmp_path, tiny_world) + WARM)
    parts = build_components(cfg)
    model = RetrievalAugmentedModel(parts.retriever, parts.reader, parts.corrector, parts.collator, cfg)
    strategy = make_strategy(cfg.strategy, parts.buffer, cfg.optim.max_steps, seed=0)
    model.parameter_groups(strategy, cfg.optim)
    corpus, examples = parts.corpus, parts.train_examples
    batch = make_batch(examples, [0, 1], corpus, cfg.algorithm, gold_passages=True)
    for ex, given in zip(examples[:2], batch.reader_passages):
        assert given == [
            (corpus[corpus.index_of(g)].title, corpus[corpus.index_of(g)].text) for g in ex.gold_passage_ids
        ]
    out = model(batch, strategy, corpus)
    assert set(out.terms) == {"reader"}
    out.loss.backward()
    assert all(p.grad is None for p in model.retriever.parameters())
    # The same loss as the reader alone on those passages: the strategy's selection plays no part.
    inputs = parts.collator(batch.questions, batch.reader_passages, batch.answers)
    with torch.no_grad():
        alone = parts.reader(**{k: inputs[k] for k in ("input_ids", "attention_mask", "labels")}).loss
    assert torch.allclose(out.loss.detach(), alone)

    no_gold = [QAExample("q1", "Who?", ["x"], [], {})]
    with pytest.raises(ValueError, match="q1 has none"):
        check_gold_passages(no_gold, corpus)
    with pytest.raises(ValueError, match="'nope' of q1 is not in the corpus"):
        check_gold_passages([QAExample("q1", "Who?", ["x"], ["nope"], {})], corpus)


def test_training_runs_the_curriculum_phases_in_order(tmp_path, tiny_world):
    cfg = load_config(
        None,
        tiny_world_overrides(tmp_path, tiny_world)
        + WARM
        + [
            "schedule.gold_passage_steps=1",
            "schedule.reader_only_steps=2",
            "schedule.final_reader_only_steps=1",
        ]
        + ["optim.max_steps=4", "log_every=1", "save_every=0"],
    )
    assert [reader_only_step(cfg, s) for s in range(4)] == [True, True, False, True]
    train(cfg)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    # Gold passages, reader-only on the selection, Algorithm 2, reader-only again at the end.
    assert ["retriever_loss" in r for r in log] == [False, False, True, False]
    assert all(r["reader_loss"] > 0 for r in log)


def test_exhaustive_re_embeds_only_after_the_retriever_has_moved(tmp_path, tiny_world):
    """The reader-only warm-up freezes the retriever, so the re-embedding schedule counts from its end."""
    cfg = load_config(
        None,
        tiny_world_overrides(tmp_path, tiny_world)
        + WARM
        + ["schedule.reader_only_steps=2", "strategy.name=exhaustive", "strategy.refresh_every=1"]
        + ["optim.max_steps=4", "log_every=1", "save_every=0"],
    )
    train(cfg)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    n = cfg.data.toy_world.num_passages
    # Steps 1-2 train the reader alone (nothing to refresh); step 3 is the first retriever update, so the
    # refresh before step 4 is the first one.
    assert [r["reembedded"] for r in log] == [0, 0, 0, n]
