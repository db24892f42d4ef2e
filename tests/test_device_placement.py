"""Device placement at every public entry point: modules on an accelerator, data handed in on the host.

Each test runs the entry point once on CPU for reference, then again with the modules on the simulated
accelerator of `device_check` (any CPU/accelerator mix raises as CUDA does, values are still computed), and
checks that the call completes, gives the same result, and returns tensors where the docstring says.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from device_check import ACCELERATOR, on_accelerator, simulated_accelerator

from rlm.reader.fid import FiDConfig, FiDReader
from rlm.reader.scoring import score_passages
from rlm.reader.small_t5 import SmallT5Config
from rlm.reader.tokenizer import train_tokenizer
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.corrector import CorrectorNetwork, corrector_ce_loss, corrector_mse_loss
from rlm.retriever.search import corrected_topk, score_rows, two_stage_corrected_topk

TINY = SmallT5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4)
SENTENCES = [
    "Alice Moreau was born in Lyon and works as a painter.",
    "Bob Tanaka was born in Osaka; he is a chemist.",
    "question: where was Alice born? title: Alice context: The city of Lyon lies on the Rhone.",
] * 20
QUESTIONS = ["where was Alice born?", "what is Bob?"]
PASSAGES = [
    [("Alice", "Alice Moreau was born in Lyon."), ("Lyon", "Lyon lies on the Rhone."), ("Bob", "A chemist.")],
    [("Bob", "Bob Tanaka was born in Osaka; he is a chemist.")],
]
ANSWERS = ["Lyon", "a chemist"]
MIX = "same device"


@pytest.fixture(scope="module")
def reader():
    tokenizer = train_tokenizer(SENTENCES, vocab_size=400, min_frequency=1)
    fid_config = FiDConfig(max_passage_length=32, max_answer_length=4)
    return FiDReader.from_config(tokenizer, TINY, fid_config=fid_config, seed=0).eval()


@pytest.fixture(scope="module")
def retriever(tiny_world):
    """The tiny retriever in MiniLM's layout (tests/tiny_run.py): placement does not depend on the weights."""
    from rlm.retriever.encoder import DualEncoder

    return DualEncoder.from_pretrained(str(tiny_world / "tiny_retriever"), max_length=32).eval()


@pytest.fixture(scope="module")
def corpus_and_dev(tiny_world):
    """The tiny world's corpus and 3 of its dev questions."""
    from rlm.data.corpus import load_corpus
    from rlm.data.qa import load_qa_dataset

    toy = tiny_world / "toy"
    return load_corpus(toy / "corpus.jsonl"), load_qa_dataset("toy", "dev", toy)[:3]


def search_inputs(dim=8, n=90, batch=3, seed=0):
    """A host buffer in three float16 shards, host queries and a corrector that is not the identity."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=-1).half()
    buffer = PassageBuffer([str(i) for i in range(n)], [emb[:20], emb[20:61], emb[61:]])
    queries = torch.nn.functional.normalize(torch.randn(batch, dim, generator=g), dim=-1)
    torch.manual_seed(seed)
    corrector = CorrectorNetwork(dim, 16, linear=True)
    with torch.no_grad():
        corrector.output.weight.normal_(std=0.3)
        corrector.linear.weight.normal_(std=0.1)
    return buffer, queries, corrector


def assert_same_topk(got, ref):
    assert on_accelerator(got.indices) and on_accelerator(got.scores)
    assert got.indices.dtype == torch.long and got.scores.dtype == torch.float32
    assert torch.equal(got.indices.cpu(), ref.indices)
    torch.testing.assert_close(got.scores.cpu(), ref.scores)


# ---- the checker itself -------------------------------------------------------------------------------


def test_simulated_accelerator_rejects_a_host_tensor_and_keeps_values(reader):
    batch = reader.collator(QUESTIONS, PASSAGES)
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    encoder = reader.model.get_encoder()
    with torch.no_grad():
        ref = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        with simulated_accelerator(reader):
            assert reader.device == ACCELERATOR
            with pytest.raises(RuntimeError, match=MIX):
                encoder(input_ids=ids, attention_mask=mask.to(ACCELERATOR))
            with pytest.raises(TypeError, match="numpy"):
                torch.ones(2, device=ACCELERATOR).numpy()
            got = encoder(input_ids=ids.to(ACCELERATOR), attention_mask=mask.to(ACCELERATOR))
            got = got.last_hidden_state
    assert on_accelerator(got) and not on_accelerator(got.cpu())
    torch.testing.assert_close(got.cpu(), ref)
    assert not on_accelerator(next(reader.parameters()))  # put back on exit


# ---- reader -------------------------------------------------------------------------------------------


def test_fid_forward_moves_its_inputs(reader):
    batch = reader.collator(QUESTIONS, PASSAGES, ANSWERS)
    with torch.no_grad():
        ref = reader(**batch)
        with simulated_accelerator(reader):
            got = reader(**batch)
    assert on_accelerator(got.loss) and on_accelerator(got.logits)
    torch.testing.assert_close(got.logits.cpu(), ref.logits)
    torch.testing.assert_close(got.loss.cpu(), ref.loss)


def test_fid_generate_moves_its_inputs(reader):
    batch = reader.collator(QUESTIONS, PASSAGES)
    ref = reader.generate(batch["input_ids"], batch["attention_mask"])
    with simulated_accelerator(reader):
        got = reader.generate(batch["input_ids"], batch["attention_mask"])
    assert on_accelerator(got)
    assert torch.equal(got.cpu(), ref)


def test_fid_answer_runs_on_the_reader_device(reader):
    ref = reader.answer(QUESTIONS, PASSAGES, batch_size=1)
    with simulated_accelerator(reader):
        assert reader.answer(QUESTIONS, PASSAGES, batch_size=1) == ref


def test_score_passages_returns_scores_on_the_reader_device(reader):
    ref = score_passages(reader, QUESTIONS, PASSAGES, ANSWERS, batch_size=3)
    with simulated_accelerator(reader):
        got = score_passages(reader, QUESTIONS, PASSAGES, ANSWERS, batch_size=3)
        # They meet the retriever's logits in the distillation loss, which live on the accelerator.
        assert on_accelerator(got)
        torch.testing.assert_close(got.cpu(), ref)
        empty = score_passages(reader, ["q"], [[]], ["a"])
        assert on_accelerator(empty) and empty.shape == (1, 0)


# ---- retriever ----------------------------------------------------------------------------------------


def test_corrector_losses_put_targets_on_the_corrected_scores_device():
    buffer, queries, corrector = search_inputs()
    stale = buffer.rows(torch.arange(12).view(3, 4)).float()
    target = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[True, True, False, True], [True] * 4, [True, False, True, True]])
    fresh = stale + 0.1

    def losses(q, rows):
        corrected = corrector(rows)
        scores = torch.einsum("bd,bkd->bk", q, corrected)
        return corrector_ce_loss(target, scores, beta=2.0, mask=mask), corrector_mse_loss(fresh, corrected)

    ref_ce, ref_mse = losses(queries, stale)
    with simulated_accelerator(corrector):
        ce, mse = losses(queries.to(ACCELERATOR), stale.to(ACCELERATOR))
        assert on_accelerator(ce) and on_accelerator(mse)
        ce.backward()  # the loss is one graph on one device
    torch.testing.assert_close(ce.cpu(), ref_ce)
    torch.testing.assert_close(mse.cpu(), ref_mse)


@pytest.mark.parametrize("corrector_dtype", [torch.float32, torch.bfloat16])
def test_corrected_topk_streams_a_host_buffer_to_the_queries_device(corrector_dtype):
    buffer, queries, corrector = search_inputs()
    corrector.to(corrector_dtype)  # bf16 parameters, as DeepSpeed's bf16 mode leaves them
    include = torch.tensor([[5, -1], [70, 70], [-1, -1]])
    kwargs = dict(chunk_size=16, include=include, num_random=4)
    ref = corrected_topk(queries, buffer, corrector, 6, generator=torch.Generator().manual_seed(3), **kwargs)
    with simulated_accelerator(corrector):
        got = corrected_topk(
            queries.to(ACCELERATOR),
            buffer,
            corrector,
            6,
            generator=torch.Generator().manual_seed(3),
            **kwargs,
        )
    assert_same_topk(got, ref)
    assert got.indices.shape == (3, 6 + 2 + 4)


@pytest.mark.parametrize("corrector_dtype", [torch.float32, torch.bfloat16])
def test_score_rows_reads_host_rows_for_device_queries(corrector_dtype):
    buffer, queries, corrector = search_inputs()
    corrector.to(corrector_dtype)
    rows = torch.tensor([[3, 3, 88], [0, 40, 21], [59, 60, 61]])
    ref = score_rows(queries, buffer, corrector, rows)
    with simulated_accelerator(corrector):
        device_queries = queries.to(ACCELERATOR)
        for given in (rows, rows.to(ACCELERATOR)):
            got = score_rows(device_queries, buffer, corrector, given)
            assert on_accelerator(got)
            torch.testing.assert_close(got.cpu(), ref)


@pytest.mark.parametrize("first_stage", ["index", "scan"])
@pytest.mark.parametrize("corrector_dtype", [torch.float32, torch.bfloat16])
def test_two_stage_corrected_topk_with_a_host_buffer(corrector_dtype, first_stage):
    from rlm.retriever.index import PassageIndex

    buffer, queries, corrector = search_inputs()
    corrector.to(corrector_dtype)
    index = PassageIndex.from_buffer(buffer, "Flat", use_gpu=False) if first_stage == "index" else None
    ref = two_stage_corrected_topk(queries, buffer, corrector, 5, index, num_candidates=30)
    with simulated_accelerator(corrector):
        got = two_stage_corrected_topk(
            queries.to(ACCELERATOR), buffer, corrector, 5, index, num_candidates=30
        )
    assert_same_topk(got, ref)


def test_encoder_moves_tokens_to_its_towers(retriever):
    texts = [f"passage number {i} about {'Lyon ' * (i % 5)}" for i in range(20)]  # > 16: bucketed path
    with torch.no_grad():
        ref_q = retriever.encode_queries(texts[:3])
        ref_p = retriever.encode_passages(texts)
    ref_encode = retriever.passage_tower.encode(texts, batch_size=8)
    with simulated_accelerator(retriever), torch.no_grad():
        got_q = retriever.encode_queries(texts[:3])
        got_p = retriever.encode_passages(texts)
        got_encode = retriever.passage_tower.encode(texts, batch_size=8)
    assert on_accelerator(got_q) and on_accelerator(got_p)
    assert not on_accelerator(got_encode)  # documented: float32 on CPU, for faiss and the buffer
    torch.testing.assert_close(got_q.cpu(), ref_q)
    torch.testing.assert_close(got_p.cpu(), ref_p)
    torch.testing.assert_close(got_encode, ref_encode)


# ---- evaluation, validation and the demo ----------------------------------------------------------


def test_run_evaluation_with_towers_and_reader_on_a_device(retriever, reader, corpus_and_dev):
    from rlm.inference.evaluation import run_evaluation

    corpus, dev = corpus_and_dev
    ref = run_evaluation(dev, corpus, retriever, reader, k=5, num_passages=2, batch_size=2)
    with simulated_accelerator(retriever, reader):
        got = run_evaluation(dev, corpus, retriever, reader, k=5, num_passages=2, batch_size=2)
    drop = ("embed_seconds", "retrieve_seconds", "read_seconds")
    assert {k: v for k, v in got.metrics.items() if k not in drop} == pytest.approx(
        {k: v for k, v in ref.metrics.items() if k not in drop}
    )
    assert [r["prediction"] for r in got.records] == [r["prediction"] for r in ref.records]


def test_validate_with_towers_and_reader_on_a_device(retriever, reader, corpus_and_dev):
    from rlm.config import BufferConfig, ReaderConfig, StrategyConfig, TrainConfig
    from rlm.training.validation import validate

    corpus, dev = corpus_and_dev
    model = SimpleNamespace(retriever=retriever, reader=reader)
    cfg = TrainConfig(
        strategy=StrategyConfig(name="corrector", k=3),
        buffer=BufferConfig(batch_size=16),
        reader=ReaderConfig(num_passages=2),
    )
    ref = validate(model, corpus, dev, cfg, batch_size=2)
    with simulated_accelerator(retriever, reader):
        got = validate(model, corpus, dev, cfg, batch_size=2)
    assert got == pytest.approx(ref) and "dev_exact_match" in got and "dev_recall@5" in got


def test_validate_from_the_strategys_selection_with_the_model_on_a_device(retriever, reader, corpus_and_dev):
    """`eval_selection`: dev questions answered from the corrector's <q, h(B)> with h, the towers and the reader
    on the accelerator and B on the host: the figures of a host run."""
    from rlm.config import BufferConfig, ReaderConfig, StrategyConfig, TrainConfig
    from rlm.training.strategies import make_strategy
    from rlm.training.validation import validate

    corpus, dev = corpus_and_dev
    buffer = PassageBuffer.from_embeddings(
        corpus.ids, retriever.passage_tower.encode(corpus.retrieval_texts()).half()
    )
    torch.manual_seed(0)
    corrector = CorrectorNetwork(buffer.dim, 32, linear=True)
    with torch.no_grad():
        corrector.output.weight.normal_(std=0.05)
    model = SimpleNamespace(retriever=retriever, reader=reader, corrector=corrector)
    cfg = TrainConfig(
        strategy=StrategyConfig(name="corrector", k=3),
        buffer=BufferConfig(batch_size=16),
        reader=ReaderConfig(num_passages=2),
    )

    def run(device):
        strategy = make_strategy(cfg.strategy, buffer, 10)
        return validate(model, corpus, dev, cfg, batch_size=2, device=device, strategy=strategy)

    ref = run(None)
    with simulated_accelerator(retriever, reader, corrector):
        got = run(ACCELERATOR)
    assert (
        got == pytest.approx(ref) and "dev_selection_exact_match" in got and "dev_selection_recall@5" in got
    )


def test_qa_service_answer_with_towers_and_reader_on_a_device(retriever, reader, corpus_and_dev):
    from rlm.app.service import QAService
    from rlm.inference.indexing import build_index, embed_corpus

    corpus, dev = corpus_and_dev
    index = build_index(embed_corpus(retriever.passage_tower, corpus.retrieval_texts()), corpus.ids)
    service = QAService(retriever, reader, corpus, index, default_k=3)
    ref = service.answer(dev[0].question)
    with simulated_accelerator(retriever, reader):
        got = service.answer(dev[0].question)
    for result in (got, ref):
        result.pop("latency_ms")
    assert got == ref and len(got["passages"]) == 3


@pytest.fixture(scope="module")
def training_parts(tmp_path_factory):
    """A tiny training setup: toy world, MiniLM towers, tiny T5, corrector, the fixed buffer on the host."""
    from rlm.components import build_components

    root = tmp_path_factory.mktemp("steps")
    overrides = [
        f"output_dir={root}/run",
        f"buffer.dir={root}/buffer",
        f"data.toy_world.dir={root}/toy",
        "data.toy_world.num_passages=100",
        "data.dev=null",
        "strategy.k=3",
        "retriever.passage_max_length=32",
        "retriever.query_max_length=24",
        "reader.d_model=32",
        "reader.d_ff=64",
        "reader.num_layers=1",
        "reader.num_decoder_layers=1",
        "reader.num_heads=2",
        "reader.d_kv=16",
        "reader.vocab_size=500",
        "reader.max_passage_length=32",
        "reader.max_answer_length=8",
    ]
    return root, overrides, build_components


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        (2, ["strategy.name=corrector"]),
        (2, ["strategy.name=snm", "strategy.snm_size=20"]),
        (2, ["strategy.name=frozen"]),  # q from the kept eval-mode queries, built on the device
        (1, ["strategy.name=corrector", "strategy.num_random=3"]),
        (1, ["strategy.name=corrector", "strategy.num_random=3", "strategy.share_across_batch=true"]),
        (1, ["strategy.name=in_batch"]),
    ],
)
def test_algorithm_steps_with_the_model_on_a_device_and_the_buffer_on_the_host(
    training_parts, algorithm, extra
):
    """Both algorithm steps, as training runs them: every loss term on the device, values as on the host."""
    from rlm.config import load_config
    from rlm.training.model import RetrievalAugmentedModel, embed_rows
    from rlm.training.schedule import make_batch
    from rlm.training.strategies import make_strategy

    root, overrides, build_components = training_parts
    cfg = load_config(None, [*overrides, f"algorithm={algorithm}", *extra])
    parts = build_components(cfg)
    model = RetrievalAugmentedModel(
        parts.retriever, parts.reader, parts.corrector, parts.collator, cfg
    ).eval()
    model.parameter_groups(make_strategy(cfg.strategy, parts.buffer, 10), cfg.optim)
    texts = parts.corpus.retrieval_texts()
    # Two-hop questions first, so Algorithm 1's other-gold rows are exercised too.
    examples = sorted(parts.train_examples, key=lambda ex: -len(ex.gold_passage_ids))

    def step():
        torch.manual_seed(0)
        model.query_cache.clear()  # the host run's kept queries are not the device run's
        strategy = make_strategy(cfg.strategy, parts.buffer, 10, seed=0)
        strategy.before_step(0, lambda rows: embed_rows(parts.retriever.passage_tower, texts, rows))
        batch = make_batch(examples, [0, 1, 2], parts.corpus, algorithm)
        return model(batch, strategy, parts.corpus)

    ref = step()
    with simulated_accelerator(model):
        got = step()
    assert on_accelerator(got.loss) and all(on_accelerator(t) for t in got.terms.values())
    torch.testing.assert_close(got.loss.as_subclass(torch.Tensor), ref.loss, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_regression_refresh_with_the_passage_tower_on_a_device(training_parts, placement):
    """Approximate re-encoding as training runs it on a GPU: samples re-embedded on the device, the fit on
    the host, the map applied to host buffer rows, the mapped rows scanned from the host or the device."""
    from rlm.config import load_config
    from rlm.retriever.distributed import Processes
    from rlm.training.model import embed_rows
    from rlm.training.strategies import make_strategy

    root, overrides, build_components = training_parts
    extra = ["strategy.name=regression", "strategy.refresh_every=1", "strategy.regression.samples=30"]
    cfg = load_config(None, [*overrides, *extra, "strategy.regression.landmarks=8"])
    parts = build_components(cfg)
    tower = parts.retriever.passage_tower.eval()
    texts = parts.corpus.retrieval_texts()
    queries = torch.nn.functional.normalize(torch.randn(2, parts.buffer.dim), dim=-1)
    with torch.no_grad():  # the tower drifts, so the refit has something to map
        for p in tower.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))

    def select(device):
        strategy = make_strategy(cfg.strategy, parts.buffer, 10, seed=0)
        strategy.distribute(Processes(), False, device=device)
        strategy.before_step(1, lambda rows: embed_rows(tower, texts, rows))
        assert strategy.reembedded == 30
        return strategy.select(queries if device is None else queries.to(device))

    ref = select(None)
    with simulated_accelerator(tower):
        got = select(ACCELERATOR if placement == "device" else None)
    if placement == "device":
        assert_same_topk(got, ref)
    else:
        assert torch.equal(got.indices, ref.indices)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_corrector_selection_keeps_h_of_b_on_the_queries_device(placement):
    """The corrector strategy's kept h(B) (`strategy.cache_corrected_mb`) with h and the queries on the
    accelerator: built there from host rows (streamed) or from rows resident on the device, reused by the next
    selection, rebuilt after h's weights change in place, and always the top-k of a host run without it."""
    from rlm.config import StrategyConfig
    from rlm.retriever.distributed import Processes
    from rlm.training.strategies import make_strategy

    buffer, queries, corrector = search_inputs()
    update = 0.5 * torch.randn(corrector.output.weight.shape, generator=torch.Generator().manual_seed(1))

    def selections(rows_device, queries_device, cache_mb):
        cfg = StrategyConfig(name="corrector", k=5, cache_corrected_mb=cache_mb)
        strategy = make_strategy(cfg, buffer, 10)
        strategy.distribute(Processes(), False, device=rows_device)
        q = queries.to(queries_device)
        picked = [strategy.select(q, corrector), strategy.select(q, corrector)]
        weight = corrector.output.weight
        with torch.no_grad():  # an optimizer step, in place
            weight.add_(update.to(weight.device))
        picked.append(strategy.select(q, corrector))
        with torch.no_grad():
            weight.sub_(update.to(weight.device))
        return picked, strategy.search._h_cache

    ref, none = selections(None, "cpu", 0)
    assert none is None
    with simulated_accelerator(corrector):
        rows_device = ACCELERATOR if placement == "device" else None
        got, kept = selections(rows_device, ACCELERATOR, 1024)
        assert kept is not None and all(on_accelerator(shard) for _, shard in kept[2].iter_chunks(1 << 20))
    for g, r in zip(got, ref, strict=True):
        assert_same_topk(g, r)
    assert not torch.equal(ref[0].indices, ref[2].indices)  # the update changed the selection


def test_an_accumulation_window_of_algorithm_2_reads_nothing_back_from_the_device(
    training_parts, monkeypatch
):
    """A window of two micro-batches, the model on the (simulated) accelerator: its forwards and backwards read
    no value of a device tensor back into Python on any thread (each such read is a host sync on a GPU). The
    rows S_x selects reach the host by a copy on the background thread; figures stay on the device. Only
    transformers' own look at each attention mask (whether it masks anything) remains, and is its code's."""
    import sys

    from rlm.config import load_config
    from rlm.training.model import RetrievalAugmentedModel
    from rlm.training.schedule import make_batch
    from rlm.training.selection import select_window
    from rlm.training.strategies import make_strategy

    root, overrides, build_components = training_parts
    cfg = load_config(None, [*overrides, "strategy.name=corrector"])
    parts = build_components(cfg)
    model = RetrievalAugmentedModel(
        parts.retriever, parts.reader, parts.corrector, parts.collator, cfg
    ).train()
    strategy = make_strategy(cfg.strategy, parts.buffer, 10)
    model.parameter_groups(strategy, cfg.optim)
    batches = [make_batch(parts.train_examples, rows, parts.corpus, 2) for rows in ([0, 1], [2, 3])]
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            # Once per read: not again where the simulated device runs it (torch functions off there).
            if on_accelerator(self) and torch._C._is_torch_function_enabled():
                caller = sys._getframe(1)
                reads.append((_name, f"{caller.f_code.co_filename}:{caller.f_lineno}"))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with simulated_accelerator(model):
        selections = select_window(model, batches, strategy, parts.corpus, cfg)  # as the loop selects
        for batch, selection in zip(batches, selections):
            out = model(batch, strategy, parts.corpus, selection=selection)
            out.loss.backward()
        assert on_accelerator(out.loss) and all(on_accelerator(v) for v in out.metrics.values())
    assert any("transformers/masking_utils.py" in where for _, where in reads)  # the count sees device reads
    assert [r for r in reads if "transformers/masking_utils.py" not in r[1]] == [], reads
