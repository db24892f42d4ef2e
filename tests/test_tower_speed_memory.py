"""The towers at a GPU's shapes, held on a CPU: the passage tower's rows in one forward on an accelerator
(buckets of 16 on a CPU), activation checkpointing of both towers (`retriever.gradient_checkpointing`), DDP's
`find_unused_parameters` only where some step leaves a trained parameter without a gradient, and DeepSpeed's
gradient accumulation in fp32 under bf16.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from local_port import accelerate_launch
from tiny_run import as_set_args, tiny_overrides, tiny_retriever

from rlm.components import build_components
from rlm.config import load_config
from rlm.retriever.encoder import CPU_BUCKET_SIZE, DualEncoder, SentenceEncoder, bucket_size_for
from rlm.training.accelerator import (
    configure_deepspeed,
    find_unused_parameters,
    reader_alone_steps,
    unreached_parameters,
)
from rlm.training.checkpointing import OPERATIONAL_KEYS
from rlm.training.model import RetrievalAugmentedModel
from rlm.training.strategies import STRATEGY_CLASSES

REPO = Path(__file__).resolve().parents[1]
# 32 passages of mixed lengths, as a step's S_x is.
PASSAGES = [" ".join(["word"] * (3 + 5 * (i % 7))) for i in range(32)]


def tiny_t5_retriever(folder: Path) -> Path:
    """GTR's layout at a test's size: a T5 encoder (2 layers of 32) + Dense, random weights; no pooler."""
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    from rlm.retriever.encoder import default_retriever_path

    if (folder / "modules.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(default_retriever_path())
    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tower = SentenceEncoder(T5EncoderModel(config), tokenizer, torch.nn.Linear(32, 32), max_length=64)
    tower.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("towers")


@pytest.fixture(scope="module", params=["bert", "t5"])
def tower_folder(request, root) -> Path:
    """A tiny tower of each family the project trains: BERT (MiniLM's, with its pooler) and T5 (GTR's)."""
    make = tiny_retriever if request.param == "bert" else tiny_t5_retriever
    return make(root / f"tiny_{request.param}")


def counting_forward(tower: SentenceEncoder, stand_in: bool) -> list[int]:
    """Count the calls of the tower's transformer (rows per call); `stand_in`: a shape-only output (meta)."""
    calls, forward = [], tower.model.forward

    def counted(input_ids, attention_mask, **kwargs):
        calls.append(len(input_ids))
        if stand_in:
            hidden = torch.zeros(*input_ids.shape, tower.hidden_size, device=input_ids.device)
            return SimpleNamespace(last_hidden_state=hidden)
        return forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    tower.model.forward = counted
    return calls


# ---- the passage tower's rows per forward -----------------------------------------------------------------


def test_a_cpu_embeds_in_buckets_of_16_and_an_accelerator_in_one_piece():
    assert bucket_size_for(torch.device("cpu")) == CPU_BUCKET_SIZE == 16
    for device in ("cuda", "cuda:3", "meta", "xpu"):
        assert bucket_size_for(torch.device(device)) is None


def test_the_passage_tower_runs_a_steps_32_passages_in_one_forward_on_an_accelerator(root):
    """The step's call (`DualEncoder.encode_passages`): two forwards of 16 on a CPU, one of 32 elsewhere (the
    meta device stands in for a GPU: a shape-only transformer, the tower's pooling and Dense on top)."""
    tower = SentenceEncoder.from_pretrained(str(tiny_retriever(root / "tiny_bert")))
    on_cpu = counting_forward(tower, stand_in=False)
    DualEncoder(copy.deepcopy(tower), tower).encode_passages(PASSAGES)
    assert on_cpu == [16, 16]

    tower.to("meta")
    on_accelerator = counting_forward(tower, stand_in=True)
    embeddings = DualEncoder(copy.deepcopy(tower), tower).encode_passages(PASSAGES)
    assert on_accelerator == [32]
    assert embeddings.shape == (32, tower.dim) and embeddings.device.type == "meta"


# ---- activation checkpointing of the towers ----------------------------------------------------------------


def saved_bytes(run) -> int:
    """Bytes of the distinct tensors autograd keeps for backward while `run()` runs its forward."""
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, sum(saved.values())


def test_a_checkpointed_tower_gives_the_same_gradients_and_keeps_less_for_backward(tower_folder):
    plain = SentenceEncoder.from_pretrained(str(tower_folder)).train()  # dropout 0.1, as training runs it
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    results = []
    for tower in (plain, checkpointed):
        torch.manual_seed(0)  # the same dropout masks; the recomputation replays them
        embeddings, kept = saved_bytes(lambda t=tower: t.embed_texts(PASSAGES[:6]))
        (embeddings * torch.linspace(-1, 1, embeddings.shape[-1])).sum().backward()
        results.append((embeddings.detach(), kept, {n: p.grad for n, p in tower.named_parameters()}))
    (plain_out, plain_kept, plain_grads), (ckpt_out, ckpt_kept, ckpt_grads) = results
    torch.testing.assert_close(ckpt_out, plain_out)
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, grad in plain_grads.items():
        if grad is None:  # BERT's pooler: no part of the embedding
            assert ckpt_grads[name] is None, name
        else:
            torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert ckpt_kept < plain_kept / 2


def test_retriever_gradient_checkpointing_turns_it_on_for_both_towers_of_a_built_run(root, tower_folder):
    base = tiny_overrides(
        root, "run", f"retriever.path={tower_folder}", f"buffer.dir={root / ('buffer_' + tower_folder.name)}"
    )
    plain = build_components(load_config(None, base)).retriever
    assert (
        not plain.query_tower.is_gradient_checkpointing and not plain.passage_tower.is_gradient_checkpointing
    )
    parts = build_components(load_config(None, [*base, "retriever.gradient_checkpointing=true"]))
    towers = parts.retriever.query_tower, parts.retriever.passage_tower
    assert towers[0] is not towers[1] and all(t.is_gradient_checkpointing for t in towers)
    # Weights and config as they were: the fixed buffer built without it stays valid (it was loaded above).
    assert (
        towers[1].fingerprint()
        == plain.passage_tower.fingerprint()
        == parts.buffer.meta["encoder_fingerprint"]
    )
    light = build_components(
        load_config(None, [*base, "retriever.query_path=layers:1", "retriever.gradient_checkpointing=true"])
    )
    assert light.retriever.query_tower.is_gradient_checkpointing


def test_the_setting_is_a_checked_operational_switch_on_in_the_paper_configs():
    assert load_config("nq").retriever.gradient_checkpointing is True
    assert load_config("quickstart").retriever.gradient_checkpointing is False
    with pytest.raises(ValueError, match="retriever.gradient_checkpointing: expected true/false"):
        load_config(None, ["retriever.gradient_checkpointing=3"])
    assert "retriever.gradient_checkpointing" in OPERATIONAL_KEYS  # a resume may turn it on or off


# ---- DDP's find_unused_parameters ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def t5_parts(root):
    """A tiny run's components with GTR's layout of tower (every tower parameter reaches the embedding)."""
    folder = tiny_t5_retriever(root / "tiny_t5")
    return build_components(
        load_config(
            None,
            tiny_overrides(root, "ddp", f"retriever.path={folder}", f"buffer.dir={root / 'buffer_tiny_t5'}"),
        )
    )


def joint_model(parts, name: str, *overrides: str) -> tuple:
    """(config, model) with the parameters strategy `name` trains left trainable, as `build_optimizer` leaves them."""
    cfg = load_config(None, [f"strategy.name={name}", *overrides])
    corrector = parts.corrector if name == "corrector" else None
    model = RetrievalAugmentedModel(parts.retriever, parts.reader, corrector, parts.collator, cfg)
    model.parameter_groups(STRATEGY_CLASSES[name], cfg.optim)
    return cfg, model


@pytest.mark.parametrize(
    "name, overrides, unused",
    [
        ("corrector", [], False),  # the paper's Algorithm 2: every step trains the three together
        ("exhaustive", [], False),
        ("corrector", ["schedule.reader_only_steps=10"], True),  # the reader alone at the first steps
        ("corrector", ["schedule.final_reader_only_steps=10"], True),
        ("corrector", ["schedule.gold_passage_steps=5", "schedule.reader_only_steps=5"], True),
        ("stale", ["schedule.reader_only_steps=10"], True),
        ("frozen", ["schedule.reader_only_steps=10"], False),  # the retriever is not trained: not in DDP
        ("closed_book", [], False),
    ],
)
def test_ddp_looks_for_unused_parameters_only_where_a_step_leaves_some_out(t5_parts, name, overrides, unused):
    cfg, model = joint_model(t5_parts, name, *overrides)
    assert find_unused_parameters(cfg, model) is unused


def test_algorithm_1_has_no_reader_alone_steps():
    cfg = load_config(None, ["algorithm=1", "strategy.name=corrector", "schedule.reader_only_steps=10"])
    assert not reader_alone_steps(cfg)


def test_a_bert_towers_pooler_is_found_unused_and_nothing_else(root):
    """MiniLM's BERT computes a pooled [CLS] output the towers never read: its pooler gets no gradient."""
    folder = tiny_retriever(root / "tiny_bert")
    parts = build_components(
        load_config(
            None,
            tiny_overrides(
                root, "bert", f"retriever.path={folder}", f"buffer.dir={root / 'buffer_tiny_bert'}"
            ),
        )
    )
    cfg, model = joint_model(parts, "corrector")
    names = [
        f"retriever.{t}.model.pooler.dense.{p}"
        for t in ("query_tower", "passage_tower")
        for p in ("weight", "bias")
    ]
    assert unreached_parameters(model) == names
    assert find_unused_parameters(cfg, model) is True
    assert all(p.grad is None for p in model.parameters())  # the probe wrote no gradient


@pytest.mark.slow
def test_two_processes_train_under_ddp_without_the_unused_parameter_search(root):
    """The paper's setting (GTR-layout towers, no reader-alone step) on 2 CPU processes: DDP's reduction must
    find every trained parameter's gradient at every step without searching the graph for the unused ones."""
    folder = tiny_t5_retriever(root / "tiny_t5")
    extra = [
        "cpu=true",
        "log_every=1",
        "save_every=0",
        "optim.max_steps=3",
        "optim.gradient_accumulation_steps=2",
    ]
    args = as_set_args(
        tiny_overrides(
            root, "ddp2", f"retriever.path={folder}", f"buffer.dir={root / 'buffer_tiny_t5'}", *extra
        )
    )
    cmd = accelerate_launch(REPO / "configs" / "accelerate" / "cpu_2proc.yaml", "-m", "rlm.train", *args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)}, timeout=600, cwd=REPO
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert "DDP: find_unused_parameters=False" in done.stdout
    log = [json.loads(line) for line in (root / "ddp2" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert all(r["grad_norm_retriever"] > 0 and r["grad_norm_corrector"] > 0 for r in log)


# ---- DeepSpeed -----------------------------------------------------------------------------------------------


def deepspeed_accelerator(mixed_precision: str, **own):
    """What `configure_deepspeed` reads of an accelerator: the plugin accelerate builds from
    configs/accelerate/deepspeed_zero2.yaml (ZeRO-2, precision set by the run), with `own` settings of a
    DeepSpeed config file of one's own."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=2)
    plugin.deepspeed_config.update(own)
    plugin.set_mixed_precision(mixed_precision)
    state = SimpleNamespace(deepspeed_plugin=plugin)
    return SimpleNamespace(
        state=state, mixed_precision=mixed_precision, num_processes=1, is_main_process=False
    )


def test_deepspeed_accumulates_bf16_gradients_in_fp32():
    from deepspeed.runtime.config import DeepSpeedConfig

    optim = load_config(None, ["optim.max_grad_norm=0"]).optim
    accelerator = deepspeed_accelerator("bf16")
    configure_deepspeed(accelerator, optim, accumulation_steps=4)
    handed = accelerator.state.deepspeed_plugin.deepspeed_config
    assert handed["data_types"] == {"grad_accum_dtype": "fp32"} and handed["bf16"]["enabled"]
    assert DeepSpeedConfig(handed).grad_accum_dtype == "fp32"  # DeepSpeed reads it where it is

    own = deepspeed_accelerator("bf16", data_types={"grad_accum_dtype": "bf16"})
    configure_deepspeed(own, optim, accumulation_steps=4)
    assert own.state.deepspeed_plugin.deepspeed_config["data_types"] == {"grad_accum_dtype": "bf16"}
    fp32 = deepspeed_accelerator("no")
    configure_deepspeed(fp32, optim, accumulation_steps=4)
    assert "data_types" not in fp32.state.deepspeed_plugin.deepspeed_config
