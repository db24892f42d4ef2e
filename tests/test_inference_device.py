"""Where `rlm evaluate` and `rlm demo` run: the towers, the reader and the corrector on `--device` (default:
the accelerator when there is one), their inputs there too, bf16 autocast with `--bf16` where it pays, the
faiss index on the GPU only for models on one, and progress bars that can be turned off.

No GPU here: PyTorch's `meta` device stands for the requested one (a CPU tensor reaching a model on it would
say so; nothing is computed, so each check stops at the model's door), and the simulated accelerator of
`device_check` where values must flow.
"""

from __future__ import annotations

import pytest
import torch
from device_check import ACCELERATOR, simulated_accelerator
from faiss_gpu_fakes import FakeGpu

from rlm.cli import main
from rlm.inference import checkpoint, evaluation, indexing
from rlm.inference.device import index_on_gpu, inference_bf16, inference_device
from rlm.inference.reading import read
from rlm.inference.retrieval import Retrieved
from rlm.precision import Bf16Support, CpuBf16Warning

META = torch.device("meta")
NATIVE = Bf16Support(True, float("nan"), "stand-in: native bf16")
EMULATED = Bf16Support(False, float("nan"), "stand-in: emulated bf16")


class Reached(Exception):
    """Raised by a hook once it has seen what a model was handed (meta tensors go no further)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A checkpoint of the tiny retriever and a tiny reader over a 100-passage toy world; a saved index."""
    from types import SimpleNamespace

    from tiny_run import tiny_retriever

    from rlm.data.corpus import load_corpus
    from rlm.data.qa import load_qa_dataset
    from rlm.data.toy_world import build_toy_world
    from rlm.reader.fid import FiDConfig, FiDReader
    from rlm.reader.small_t5 import SmallT5Config
    from rlm.reader.tokenizer import train_tokenizer
    from rlm.retriever.encoder import DualEncoder
    from rlm.retriever.index import PassageIndex

    root = tmp_path_factory.mktemp("inference_device")
    world = build_toy_world(root / "world", num_passages=100, max_questions={"dev": 4})
    corpus, dev = load_corpus(world.corpus), load_qa_dataset("toy", "dev", world.root)
    ckpt = root / "ckpt"
    retriever = DualEncoder.from_pretrained(str(tiny_retriever(root / "tiny")), max_length=32)
    retriever.save_pretrained(ckpt / "retriever")
    tokenizer = train_tokenizer(list(corpus.retrieval_texts()), vocab_size=300, min_frequency=1)
    FiDReader.from_config(
        tokenizer,
        SmallT5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2),
        fid_config=FiDConfig(max_passage_length=32, max_answer_length=4),
        seed=0,
    ).save_pretrained(ckpt / "reader")
    (ckpt / "config.yaml").write_text(f"reader:\n  num_passages: 2\ndata:\n  corpus: {world.corpus}\n")
    embeddings = indexing.embed_corpus(retriever.passage_tower, corpus.retrieval_texts())
    PassageIndex.build(embeddings, corpus.ids, use_gpu=False).save(root / "index")
    return SimpleNamespace(world=world, corpus=corpus, dev=dev, ckpt=ckpt, index=root / "index")


def parameter_devices(*models) -> set[torch.device]:
    return {p.device for model in models for p in model.parameters()}


def tensor_devices(args, kwargs) -> set[torch.device]:
    values = [*args, *kwargs.values()]
    return {v.device for v in values if isinstance(v, torch.Tensor)}


# ---- the models and what they are handed -------------------------------------------------------------------


def test_load_checkpoint_puts_the_towers_and_the_reader_on_the_requested_device(run, monkeypatch):
    retriever, reader, config = checkpoint.load_checkpoint(run.ckpt, device="meta")
    assert parameter_devices(retriever, reader) == {META} and config["reader"]["num_passages"] == 2
    # The default: the accelerator when there is one.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert inference_device(None) == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert inference_device(None) == torch.device("cpu")
    assert parameter_devices(*checkpoint.load_checkpoint(run.ckpt)[:2]) == {torch.device("cpu")}


def test_the_demo_service_hands_its_models_their_inputs_on_the_requested_device(run, monkeypatch):
    """Every tensor the towers and the reader get is on the device asked for: a CPU tensor there (the
    collator's, the tokenizer's) would fail on a GPU."""
    from rlm.app.service import QAService, ServiceOptions

    seen: dict[str, set] = {}
    load = checkpoint.load_checkpoint

    def stop_at(name):
        def hook(module, args, kwargs):
            seen[name] = tensor_devices(args, kwargs)
            raise Reached(name)

        return hook

    def hooked(*args, **kwargs):
        retriever, reader, config = load(*args, **kwargs)
        seen["parameters"] = parameter_devices(retriever, reader)
        retriever.query_tower.model.register_forward_pre_hook(stop_at("query tower"), with_kwargs=True)
        return retriever, reader, config

    monkeypatch.setattr(checkpoint, "load_checkpoint", hooked)
    # The warm-up question is the first to reach the query tower.
    with pytest.raises(Reached, match="query tower"):
        QAService.from_checkpoint(run.ckpt, options=ServiceOptions(index_path=run.index, device="meta"))
    assert seen == {"parameters": {META}, "query tower": {META}}

    _, reader, _ = load(run.ckpt, need_retriever=False, device="meta")

    def encode(input_ids, attention_mask, live_slots=None):
        seen["reader"] = tensor_devices((input_ids, attention_mask), {})
        raise Reached("reader")

    monkeypatch.setattr(reader, "encode", encode)
    retrieved = Retrieved([list(run.corpus.ids[:2])], [[1.0, 0.5]])
    with pytest.raises(Reached, match="reader"):
        read(reader, run.dev[:1], run.corpus, retrieved, num_passages=2)
    assert seen["reader"] == {META}


def test_h_of_b_runs_on_the_correctors_device_and_lands_on_the_host():
    from rlm.inference.corrected_index import CorrectedRows
    from rlm.retriever.buffer import PassageBuffer
    from rlm.retriever.corrector import CorrectorNetwork

    g = torch.Generator().manual_seed(0)
    rows = torch.nn.functional.normalize(torch.randn(50, 8, generator=g), dim=-1).half()
    buffer = PassageBuffer([str(i) for i in range(50)], [rows[:20], rows[20:]])
    torch.manual_seed(0)
    corrector = CorrectorNetwork(8, 16, linear=True)
    with torch.no_grad():
        corrector.output.weight.normal_(std=0.3)
    ref = torch.cat([rows for _, rows in CorrectedRows(buffer, corrector).iter_chunks(16)])
    with simulated_accelerator(corrector):
        got = torch.cat([rows for _, rows in CorrectedRows(buffer, corrector).iter_chunks(16)])
        gathered = CorrectedRows(buffer, corrector).rows(torch.tensor([3, 41, 20]))
    assert got.dtype == ref.dtype == torch.float32 and got.device.type == "cpu" and (got == ref).all()
    torch.testing.assert_close(gathered, ref[[3, 41, 20]])  # the same rows through h, in other batches


# ---- bf16 --------------------------------------------------------------------------------------------


def test_bf16_runs_on_an_accelerator_and_on_cpu_only_where_it_is_native():
    assert inference_bf16("cuda", True) is True
    assert inference_bf16("cpu", True, support=NATIVE) is True
    with pytest.warns(CpuBf16Warning, match="--bf16 ignored: bf16 is slow on this CPU.*float32"):
        assert inference_bf16("cpu", True, support=EMULATED) is False
    assert inference_bf16("cpu", False, support=NATIVE) is False


@pytest.mark.parametrize("native", [True, False], ids=["native", "emulated"])
def test_the_demo_service_answers_under_bf16_autocast_only_where_it_pays(run, monkeypatch, native):
    from rlm.app.service import QAService, ServiceOptions

    monkeypatch.setattr("rlm.precision.cpu_bf16_support", lambda probe=True: NATIVE if native else EMULATED)
    autocast: dict[str, tuple] = {}

    def watch(name):
        def hook(module, args):
            autocast[name] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))

        return hook

    load = checkpoint.load_checkpoint

    def hooked(*args, **kwargs):
        retriever, reader, config = load(*args, **kwargs)
        retriever.query_tower.model.register_forward_pre_hook(watch("query tower"))
        reader.model.get_encoder().register_forward_pre_hook(watch("reader"))
        return retriever, reader, config

    monkeypatch.setattr(checkpoint, "load_checkpoint", hooked)
    options = ServiceOptions(index_path=run.index, device="cpu", bf16=True)
    if native:
        service = QAService.from_checkpoint(run.ckpt, options=options)
    else:
        with pytest.warns(CpuBf16Warning):
            service = QAService.from_checkpoint(run.ckpt, options=options)
    assert service.bf16 is native
    assert autocast["query tower"][0] is autocast["reader"][0] is native  # the warm-up question
    if native:
        assert autocast["query tower"][1] == autocast["reader"][1] == torch.bfloat16


# ---- the faiss index follows the models ---------------------------------------------------------------


def test_the_faiss_index_follows_the_one_default_device_of_the_models(monkeypatch):
    """`index_on_gpu(None)` asks `inference_device` where the models go: one default, not two to keep equal."""
    from rlm.inference import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # None: the index on a GPU when faiss sees one.
    assert inference_device(None).type == "cuda" and index_on_gpu(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert inference_device(None).type == "cpu" and index_on_gpu(None) is False
    monkeypatch.setattr(device, "inference_device", lambda d=None: torch.device(d or "cuda"))
    # The models' default moved to the accelerator: the index goes with them.
    assert index_on_gpu(None) is None
    assert index_on_gpu("cpu") is False


def test_the_index_goes_to_the_gpu_only_with_models_on_one(run, monkeypatch):
    """With faiss-gpu seeing a GPU, `rlm evaluate --device cpu` (models on the host) keeps its index on the
    host; models on the accelerator get it on the GPU."""
    retriever, reader, _ = checkpoint.load_checkpoint(run.ckpt, device="cpu")
    fake = FakeGpu(monkeypatch, ngpu=1)
    ref = evaluation.run_evaluation(run.dev, run.corpus, retriever, None, k=5)
    assert fake.all_gpus_calls == 0
    assert indexing.load_index_for(run.index, run.corpus.ids, index_on_gpu("cpu")).on_gpu is False
    with simulated_accelerator(retriever):
        got = evaluation.run_evaluation(run.dev, run.corpus, retriever, None, k=5)
    assert fake.all_gpus_calls == 1
    assert [r["retrieved_ids"] for r in got.records] == [r["retrieved_ids"] for r in ref.records]
    assert indexing.load_index_for(run.index, run.corpus.ids, index_on_gpu(ACCELERATOR)).on_gpu


# ---- the commands -------------------------------------------------------------------------------------


def evaluate_argv(run, *extra: str) -> list[str]:
    return ["evaluate", "--checkpoint", str(run.ckpt), "--data-path", str(run.world.root), "--k", "5", *extra]


@pytest.fixture
def captured_evaluation(monkeypatch):
    """`run_evaluation` replaced by a recorder of where the models are and which autocast is on."""
    seen = {}

    def record(examples, corpus=None, retriever=None, reader=None, **kwargs):
        seen.update(
            devices=parameter_devices(retriever, reader),
            autocast=(torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
            show_progress=kwargs["show_progress"],
        )
        return evaluation.EvaluationResult(metrics={"num_questions": len(examples)})

    monkeypatch.setattr(evaluation, "run_evaluation", record)
    return seen


def test_rlm_evaluate_device_and_bf16_reach_the_models(run, monkeypatch, captured_evaluation, capsys):
    seen = captured_evaluation
    assert main(evaluate_argv(run, "--device", "meta", "--no-progress")) == 0
    assert seen["devices"] == {META} and seen["autocast"][0] is False and seen["show_progress"] is False
    assert "running on meta in float32" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("rlm.precision.cpu_bf16_support", lambda probe=True: NATIVE)
    assert main(evaluate_argv(run, "--bf16")) == 0  # no --device: the CPU, there being no accelerator
    assert seen["devices"] == {torch.device("cpu")} and seen["autocast"] == (True, torch.bfloat16)
    assert seen["show_progress"] is True
    assert "running on cpu under bf16 autocast" in capsys.readouterr().out
    monkeypatch.setattr("rlm.precision.cpu_bf16_support", lambda probe=True: EMULATED)
    with pytest.warns(CpuBf16Warning, match="running in float32"):
        assert main(evaluate_argv(run, "--device", "cpu", "--bf16")) == 0
    assert seen["autocast"][0] is False


def test_rlm_demo_device_and_bf16_reach_the_service(monkeypatch, tmp_path):
    from rlm.app.service import QAService

    seen = {}

    def from_checkpoint(checkpoint, corpus_path=None, options=None):
        seen.update(vars(options))
        raise Reached("service")

    monkeypatch.setattr(QAService, "from_checkpoint", from_checkpoint)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the demo's CPU setting, not this test's
    with pytest.raises(Reached):
        main(["demo", "--checkpoint", str(tmp_path), "--device", "cuda:1", "--bf16", "--no-progress"])
    assert (seen["device"], seen["bf16"], seen["show_progress"]) == ("cuda:1", True, False)
    with pytest.raises(Reached):
        main(["demo", "--checkpoint", str(tmp_path)])
    assert (seen["device"], seen["bf16"], seen["show_progress"]) == (None, False, True)


def test_a_device_torch_does_not_know_is_one_error_line_before_anything_loads(run, monkeypatch, capsys):
    from rlm.app.service import QAService

    def from_checkpoint(*args, **kwargs):
        raise AssertionError("the demo loaded a checkpoint for a device it cannot run on")

    monkeypatch.setattr(QAService, "from_checkpoint", from_checkpoint)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    assert main(["demo", "--checkpoint", str(run.ckpt), "--device", "gpu"]) == 2
    assert main(evaluate_argv(run, "--device", "gpu")) == 2
    err = capsys.readouterr().err
    assert err.count("error: unknown device 'gpu': use cpu, cuda or cuda:N") == 2 and "Traceback" not in err


# ---- progress bars ------------------------------------------------------------------------------------


def test_rlm_evaluate_shows_progress_over_the_corpus_the_index_and_the_reading_unless_told_not_to(
    run, tmp_path, capsys
):
    argv = evaluate_argv(run, "--device", "cpu", "--batch-size", "2", "--no-policy")
    assert main([*argv, "--out", str(tmp_path / "shown")]) == 0
    err = capsys.readouterr().err
    for bar in ("encode", "index", "read"):
        assert f"{bar}: 100%" in err, (bar, err[-2000:])
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--no-progress"]) == 0
    err = capsys.readouterr().err  # transformers' own "Loading weights" bar is not ours to turn off
    assert not any(f"{bar}: " in err for bar in ("encode", "index", "read")), err[-2000:]
    shown, quiet = ((tmp_path / name / "predictions.jsonl").read_text() for name in ("shown", "quiet"))
    assert shown == quiet


def test_reading_batch_by_batch_answers_as_the_reader_does(run):
    _, reader, _ = checkpoint.load_checkpoint(run.ckpt, need_retriever=False, device="cpu")
    questions = [ex.question for ex in run.dev]
    expected = reader.answer_with_confidence(questions, [[] for _ in questions], batch_size=3)
    got = read(reader, run.dev, batch_size=3, with_confidence=True, show_progress=True)
    assert got == expected and len(got) == 4
