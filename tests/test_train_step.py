"""Algorithm 2 and 1 steps on real components: a tiny random-init retriever in MiniLM's layout (tests/tiny_run.py),
a tiny T5 reader, the toy world."""

from __future__ import annotations

import pytest
import torch
from tiny_run import tiny_overrides

from rlm.components import build_components
from rlm.config import load_config
from rlm.training.model import RetrievalAugmentedModel
from rlm.training.schedule import make_batch
from rlm.training.strategies import StaleStrategy, make_strategy


@pytest.fixture(scope="module")
def step_world(tmp_path_factory):
    """A folder holding a 150-passage toy world with dev questions (`data.dev=toy`), the tiny retriever and its
    buffer, built here once and shared by the tests of this module (each test builds its own components over
    them). Not the session's `tiny_world` (120 passages): the step tests write their runs and hard-subcorpus
    files into this folder, and the MiniLM tests add that retriever's buffer beside the tiny one's."""
    root = tmp_path_factory.mktemp("train")
    cfg, parts, _, _ = make_parts(root)
    assert len(parts.corpus) == 150 and len(parts.buffer) == 150
    return root


def make_parts(root, *overrides, minilm=False):
    """Components of the tiny run (tests/tiny_run.py) over the module's world, with dev questions; `minilm`: the
    packaged retriever (and its own buffer) instead of the tiny one, for what needs a retriever whose scores
    tell passages apart."""
    shape = ["data.toy_world.num_passages=150", "data.dev=toy", "data.max_dev_examples=8"]
    cfg = load_config(None, tiny_overrides(root, "run", *shape, *overrides, minilm=minilm))
    torch.manual_seed(0)
    parts = build_components(cfg)
    model = RetrievalAugmentedModel(parts.retriever, parts.reader, parts.corrector, parts.collator, cfg)
    strategy = make_strategy(cfg.strategy, parts.buffer, cfg.optim.max_steps, seed=0)
    return cfg, parts, model, strategy


def params_of(module):
    return [p for p in module.parameters() if p.requires_grad]


def grads(loss, params):
    return torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)


def moved(grad_list):
    return any(g is not None and g.abs().sum() > 0 for g in grad_list)


@pytest.mark.parametrize("algorithm", [2, 1, "1-shared"])
def test_gradient_isolation(step_world, algorithm):
    overrides = {
        2: [],
        1: ["algorithm=1", "strategy.num_random=4"],
        "1-shared": ["algorithm=1", "strategy.num_random=4", "strategy.share_across_batch=true"],
    }[algorithm]
    algorithm = 2 if algorithm == 2 else 1
    cfg, parts, model, strategy = make_parts(step_world, *overrides)
    model.parameter_groups(strategy, cfg.optim)  # sets requires_grad per strategy
    batch = make_batch(parts.train_examples, list(range(4)), parts.corpus, cfg.algorithm)
    out = model(batch, strategy, parts.corpus)
    # Give the corrector something to learn from: at init it is the identity and B_y ~ g(y).
    assert set(out.terms) >= {"retriever", "corrector"}
    corrector, retriever = params_of(model.corrector), params_of(model.retriever)
    # The corrector loss moves only the corrector.
    g = grads(out.terms["corrector"], corrector + retriever)
    assert moved(g[: len(corrector)])
    assert all(x is None for x in g[len(corrector) :])
    # The task losses never move the corrector; each moves its own component.
    g = grads(out.terms["retriever"], corrector + retriever)
    assert all(x is None for x in g[: len(corrector)])
    assert moved(g[len(corrector) :])
    if algorithm == 2:
        reader = params_of(model.reader)
        assert all(x is None for x in grads(out.terms["retriever"], reader))  # P_a is a fixed target
        g = grads(out.terms["reader"], corrector + retriever + reader)
        assert all(x is None for x in g[: len(corrector) + len(retriever)])  # FiD reads text, not scores
        assert moved(g[len(corrector) + len(retriever) :])


def test_fresh_corrector_selects_exactly_the_stale_top_k(step_world):
    cfg, parts, model, strategy = make_parts(step_world)
    stale = make_strategy(
        load_config(None, ["strategy.name=stale", "strategy.k=4"]).strategy, parts.buffer, 10
    )
    queries = model.retriever.encode_queries([ex.question for ex in parts.train_examples[:6]]).detach()
    a, b = strategy.select(queries, model.corrector), stale.select(queries)
    assert torch.equal(a.indices, b.indices)


@pytest.mark.slow
@pytest.mark.learning
def test_each_loss_falls_on_a_repeated_batch(step_world):
    """On MiniLM: a random-init retriever scores every passage about the same (mean cosine 0.96 for the tiny
    one), so the corrector's target is near uniform and has nothing to learn in a few steps."""
    cfg, parts, model, strategy = make_parts(
        step_world, "optim.lr_retriever=3e-5", "optim.lr_reader=3e-3", "optim.lr_corrector=1e-3", minilm=True
    )
    groups = model.parameter_groups(strategy, cfg.optim)
    optimizer = torch.optim.Adam(groups)
    batch = make_batch(parts.train_examples, list(range(4)), parts.corpus, cfg.algorithm)
    model.retriever.eval()  # no dropout: the corrector's target then moves only as the towers learn

    def run(steps):
        history = []
        for _ in range(steps):
            out = model(batch, strategy, parts.corpus)
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
            history.append({k: float(v.detach()) for k, v in out.terms.items()})
        return history

    def falls(history, key):
        return min(h[key] for h in history[-2:]) < history[0][key]

    lr = {g["name"]: g for g in optimizer.param_groups}
    # Reader held still: P_a is a fixed target, so the retriever loss must fall.
    lr["reader"]["lr"] = 0.0
    history = run(5)
    assert falls(history, "retriever"), [h["retriever"] for h in history]
    # Towers held still after a drift of the passage tower: the corrector must learn to follow it.
    with torch.no_grad():
        for p in model.retriever.passage_tower.parameters():
            p.mul_(1 + 0.05 * torch.randn_like(p))
    lr["retriever"]["lr"] = 0.0
    history = run(4)
    assert falls(history, "corrector"), [h["corrector"] for h in history]
    # And the reader learns the answers.
    lr["reader"]["lr"] = 3e-3
    history = run(3)
    assert falls(history, "reader"), [h["reader"] for h in history]


def schedule_of(root, *overrides, max_steps, **kw):
    """A strategy over the module's buffer and nothing else: re-embedding schedules are arithmetic on rows, so
    they need no towers and no reader (see `random_rows`)."""
    from rlm.retriever.buffer import PassageBuffer

    cfg = load_config(None, tiny_overrides(root, "run", *overrides))
    return make_strategy(cfg.strategy, PassageBuffer.load(cfg.buffer.dir), max_steps=max_steps, seed=0, **kw)


def random_rows(strategy, counted=None):
    """What a refresh re-embeds, as fresh unit rows of the buffer's width: the schedule counts rows, whatever
    their values."""

    def embed(rows):
        if counted is not None:
            counted.append(len(rows))
        return torch.nn.functional.normalize(torch.randn(len(rows), strategy.buffer.dim), dim=-1)

    return embed


@pytest.mark.parametrize(
    "name, extra, expected",
    [
        ("corrector", [], lambda n: 0),
        ("stale", [], lambda n: 0),
        ("frozen", [], lambda n: 0),
        ("exhaustive", ["strategy.refresh_every=2"], lambda n: 2 * n),  # before steps 2 and 4
        ("snm", ["strategy.refresh_every=2", "strategy.snm_size=20"], lambda n: 3 * 20),  # steps 0, 2, 4
        ("two_round", [], lambda n: n),  # once, before step 5 // 2 = 2
        # s' samples before steps 2 and 4; the other rows are mapped, not re-embedded
        ("regression", ["strategy.refresh_every=2", "strategy.regression.samples=30"], lambda n: 2 * 30),
    ],
)
def test_reembedding_counts(step_world, name, extra, expected):
    strategy = schedule_of(step_world, f"strategy.name={name}", *extra, max_steps=5)
    queries = torch.nn.functional.normalize(torch.randn(3, strategy.buffer.dim), dim=-1)
    corrector = make_parts(step_world)[2].corrector if name == "corrector" else None
    counted = []
    for step in range(5):
        strategy.before_step(step, random_rows(strategy, counted))
        top = strategy.select(queries, corrector)
        assert top.indices.shape == (3, 4) and bool((top.indices >= 0).all())
    assert strategy.reembedded == sum(counted) == expected(len(strategy.buffer))


@pytest.mark.parametrize(
    "name, extra, refreshed_before",
    [
        ("exhaustive", ["strategy.refresh_every=2"], [5, 7]),  # 2 and 4 retriever updates after step 3
        ("snm", ["strategy.refresh_every=2", "strategy.snm_size=20"], [0, 5, 7]),  # a subset from step 0
        ("two_round", [], [5]),  # halfway through the 5 steps that train the retriever
        ("regression", ["strategy.refresh_every=2", "strategy.regression.samples=30"], [5, 7]),
    ],
)
def test_reembedding_schedule_counts_from_the_first_retriever_update(
    step_world, name, extra, refreshed_before
):
    strategy = schedule_of(step_world, f"strategy.name={name}", *extra, max_steps=8, start_step=3)
    counts = []
    for step in range(8):
        before = strategy.reembedded
        strategy.before_step(step, random_rows(strategy))
        counts.append(strategy.reembedded - before)
    assert [step for step, c in enumerate(counts) if c] == refreshed_before


@pytest.mark.parametrize(
    "name, extra, refreshed_before",
    [
        # every 2 retriever updates from step 3, and once more at step 8 where the retriever stops
        ("exhaustive", ["strategy.refresh_every=2"], [5, 7, 8]),
        ("exhaustive", ["strategy.refresh_every=5"], [8]),
        ("snm", ["strategy.refresh_every=2", "strategy.snm_size=20"], [0, 5, 7]),
        ("two_round", [], [5]),  # halfway through the 5 steps that train the retriever
    ],
)
def test_no_refresh_after_the_retriever_stops_training(step_world, name, extra, refreshed_before):
    """Algorithm 2's final reader-only phase (steps 8-11 here) does not move the passage tower: a refresh
    there would re-embed the same tower again and count passages that bought nothing."""
    strategy = schedule_of(
        step_world, f"strategy.name={name}", *extra, max_steps=12, start_step=3, stop_step=8
    )
    refreshed = []
    for step in range(12):
        before = strategy.reembedded
        strategy.before_step(step, random_rows(strategy))
        refreshed += [step] if strategy.reembedded > before else []
    assert refreshed == refreshed_before


def test_refreshed_exhaustive_buffer_follows_the_live_tower(step_world):
    from rlm.training.model import embed_rows

    cfg, parts, model, strategy = make_parts(
        step_world, "strategy.name=exhaustive", "strategy.refresh_every=1"
    )
    with torch.no_grad():
        for p in model.retriever.passage_tower.parameters():
            p.add_(0.01 * torch.randn_like(p))
    texts = parts.corpus.retrieval_texts()
    strategy.before_step(1, lambda rows: embed_rows(model.retriever.passage_tower, texts, rows))
    fresh = model.retriever.passage_tower.encode([texts[i] for i in range(5)])
    torch.testing.assert_close(strategy.search_space()[:5], fresh, atol=1e-5, rtol=0)
    assert not torch.allclose(parts.buffer.embeddings[:5].float(), fresh, atol=1e-3)


@pytest.mark.learning
def test_regression_maps_every_row_towards_the_live_tower_from_a_few_re_embedded_ones(step_world):
    """Dynnibal's approximate re-encoding: 60 of 150 passages re-embedded, all 150 rows move towards what the
    live passage tower gives, the 90 never re-embedded included; the landmarks stay fixed across refits."""
    from rlm.training.model import embed_rows

    cfg, parts, model, strategy = make_parts(
        step_world,
        "strategy.name=regression",
        "strategy.refresh_every=1",
        "strategy.regression.samples=60",
        "strategy.regression.landmarks=32",
    )
    texts = parts.corpus.retrieval_texts()
    tower = model.retriever.passage_tower
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a drift that changes rankings, as training does
        for p in tower.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=generator))
    embedded = []

    def embed(rows):
        embedded.extend(rows)
        return embed_rows(tower, texts, rows)

    strategy.before_step(1, embed)
    assert len(embedded) == strategy.reembedded == 60
    fresh = tower.encode(texts).float()
    stale = parts.buffer.embeddings.float()
    mapped = strategy.search_space().float()
    unseen = torch.tensor(sorted(set(range(len(texts))) - set(embedded)))
    before = (stale[unseen] - fresh[unseen]).square().sum()
    after = (mapped[unseen] - fresh[unseen]).square().sum()
    assert after < 0.7 * before, (float(after), float(before))
    assert strategy.pop_metrics()["regression_residual"] < 0.7
    landmarks = strategy.landmark_rows.clone()
    strategy.before_step(2, embed)
    assert torch.equal(strategy.landmark_rows, landmarks) and strategy.reembedded == 120


def test_closed_book_reads_no_passages(step_world):
    cfg, parts, model, strategy = make_parts(step_world, "strategy.name=closed_book")
    batch = make_batch(parts.train_examples, [0, 1], parts.corpus, 2)
    out = model(batch, strategy, parts.corpus)
    assert set(out.terms) == {"reader"} and torch.isfinite(out.loss)


def test_validation_reports_em_and_recall_on_the_corpus_and_on_a_hard_subcorpus(step_world):
    from rlm.training.hard_subcorpus import save_subcorpus_ids
    from rlm.training.validation import validate

    cfg, parts, model, strategy = make_parts(step_world)
    dev = parts.dev_examples[:6]
    full = validate(model, parts.corpus, dev, cfg)
    assert {"dev_exact_match", "dev_f1", "dev_recall@1", "dev_gold_recall@5"} <= set(full)
    assert 0 <= full["dev_gold_recall@1"] <= full["dev_gold_recall@5"] <= 1
    # DAFT's watch on the towers: the starting towers are one model (KL 0), and not collapsed.
    assert full["dev_query_passage_knn_kl"] == pytest.approx(0.0, abs=1e-3)
    assert 0 < full["dev_query_mean_cosine"] < cfg.retriever.collapse_cosine
    # A subcorpus of exactly the gold passages: every question's gold passage is then in its top 5.
    ids = sorted({pid for ex in dev for pid in ex.gold_passage_ids})
    save_subcorpus_ids(ids, step_world / "hard.txt")
    cfg.data.dev_subcorpus = str(step_world / "hard.txt")
    hard = validate(model, parts.corpus, dev, cfg)
    assert hard["dev_gold_recall@5"] == 1.0


def test_validation_embeds_the_corpus_again_only_when_the_passage_tower_moved(step_world, monkeypatch):
    """Validation embeds its share of the corpus through the buffer's path (`embed_passages`: sorted batches,
    float16 rows, half of float32's memory for the rows the cache keeps) and again only when the tower moved."""
    from rlm.training import validation
    from rlm.training.hard_subcorpus import save_subcorpus_ids
    from rlm.training.validation import PassageEmbeddingCache, validate

    cfg, parts, model, strategy = make_parts(step_world)
    dev = parts.dev_examples[:6]
    tower = model.retriever.passage_tower
    embedded = []  # passages the tower embedded, per call
    embed_passages = validation.embed_passages

    def counted(encoder, texts, start, stop, *args, **kw):
        embedded.append(stop - start)
        return embed_passages(encoder, texts, start, stop, *args, **kw)

    monkeypatch.setattr(validation, "embed_passages", counted)
    cache = PassageEmbeddingCache()
    first = validate(model, parts.corpus, dev, cfg, cache=cache)
    again = validate(model, parts.corpus, dev, cfg, cache=cache)  # the reader may have moved, the tower not
    assert again == first and embedded == [len(parts.corpus)] and (cache.hits, cache.misses) == (1, 1)
    assert cache.vectors.dtype == torch.float16 and cache.vectors.shape == (
        len(parts.corpus),
        parts.buffer.dim,
    )
    # Another corpus (the hard subcorpus) is embedded, not served from the whole corpus's rows.
    ids = sorted({pid for ex in dev for pid in ex.gold_passage_ids})
    save_subcorpus_ids(ids, step_world / "hard_cache.txt")
    cfg.data.dev_subcorpus = str(step_world / "hard_cache.txt")
    hard = validate(model, parts.corpus, dev, cfg, cache=cache)
    assert embedded == [len(parts.corpus), len(ids)] and hard["dev_gold_recall@5"] == 1.0
    cfg.data.dev_subcorpus = None
    # The tower moved: the corpus is embedded again and the figures are the new tower's.
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = validate(model, parts.corpus, dev, cfg, cache=cache)
    assert embedded == [len(parts.corpus), len(ids), len(parts.corpus)]
    assert moved == validate(model, parts.corpus, dev, cfg)  # no cache: the same figures
    assert (cache.hits, cache.misses) == (1, 3)


def test_in_batch_scores_exactly_the_batchs_gold_passages(step_world):
    cfg, parts, model, strategy = make_parts(step_world, "algorithm=1", "strategy.name=in_batch")
    batch = make_batch(parts.train_examples, list(range(5)), parts.corpus, 1)
    top = strategy.select(torch.zeros(5, parts.buffer.dim), include=batch.gold_rows[:, None])
    assert torch.equal(top.indices, batch.gold_rows[:, None])
    out = model(batch, strategy, parts.corpus)
    assert torch.isfinite(out.loss) and "corrector" not in out.terms


def test_retriever_dropout_setting_reaches_both_towers(step_world):
    """`retriever.dropout=0`: g(y) in train mode equals the eval-mode buffer row; MiniLM's own 0.1 does not."""
    texts = ["Ada Lovelace was born in London.", "Paris is in France."]

    def gap(tower):
        with torch.no_grad():
            clean = tower.eval().embed_texts(texts)
            noisy = tower.train().embed_texts(texts)
        return float((noisy - clean).norm(dim=-1).max())

    _, parts, _, _ = make_parts(step_world)
    assert gap(parts.retriever.passage_tower) > 0.05
    _, parts, _, _ = make_parts(step_world, "retriever.dropout=0")
    assert gap(parts.retriever.passage_tower) == 0.0 and gap(parts.retriever.query_tower) == 0.0
    with pytest.raises(ValueError, match="dropout must be in"):
        parts.retriever.passage_tower.set_dropout(1.5)


def test_a_questions_other_gold_passages_are_not_its_negatives(step_world):
    """Multi-hop (HotpotQA): the label is the first gold passage; the second is left out of the softmax."""
    from rlm.data.qa import QAExample
    from rlm.retriever.search import TopK
    from rlm.training.steps import algorithm1_step

    cfg, parts, model, _ = make_parts(step_world, "algorithm=1")
    ids = parts.corpus.ids
    example = QAExample("mh", "Who founded the firm that employs Ada?", ["x"], [ids[3], ids[7]], {})
    batch = make_batch([example], [0], parts.corpus, 1)
    assert batch.gold_rows.tolist() == [3] and batch.other_gold_rows.tolist() == [[7]]

    class Fixed(StaleStrategy):
        def __init__(self, rows):
            super().__init__(cfg.strategy, parts.buffer, 10)
            self.fixed = torch.tensor([rows])

        def select(self, queries, corrector=None, include=None, num_random=0):
            return TopK(torch.zeros(self.fixed.shape), self.fixed)

    model.eval()  # no dropout: the two losses below see the same embeddings
    with torch.no_grad():
        with_other = algorithm1_step(model, batch, Fixed([3, 7, 11, 12]), parts.corpus, cfg)
        without = algorithm1_step(model, batch, Fixed([3, -1, 11, 12]), parts.corpus, cfg)
        batch.other_gold_rows = None  # the old behaviour: the second hop is pushed down as a negative
        as_negative = algorithm1_step(model, batch, Fixed([3, 7, 11, 12]), parts.corpus, cfg)
    torch.testing.assert_close(with_other.terms["retriever"], without.terms["retriever"])
    assert as_negative.terms["retriever"] > with_other.terms["retriever"]


@pytest.mark.parametrize("name", ["corrector", "frozen"])
def test_steps_that_leave_the_retriever_as_it_is_select_with_eval_mode_queries_embedded_once(
    step_world, name
):
    """A reader-only step (or any step of a frozen retriever) selects S_x with q = f(x) as at prediction time
    (the query tower in eval mode: no dropout), each question embedded once while f does not move; a step that
    trains the retriever embeds with gradient in train mode and forgets the kept queries."""
    cfg, parts, model, strategy = make_parts(step_world, f"strategy.name={name}", "retriever.dropout=0.5")
    model.parameter_groups(strategy, cfg.optim)
    model.train()
    batch = make_batch(parts.train_examples, list(range(4)), parts.corpus, 2)
    tower = model.retriever.query_tower
    expected = tower.encode(batch.questions)  # eval mode, as validation and `rlm evaluate` embed them
    forwards, selected = [], []
    tower.register_forward_hook(lambda module, args, out: forwards.append(out.shape[0]))
    select = strategy.select

    def recording(queries, *args, **kw):
        selected.append(queries.detach().clone())
        return select(queries, *args, **kw)

    strategy.select = recording
    model(batch, strategy, parts.corpus, reader_only=True)
    model(batch, strategy, parts.corpus, reader_only=True)
    assert forwards == [4] and model.query_cache.hits == 4  # the second step embeds nothing
    assert tower.training  # the tower goes back to train mode
    for queries in selected:
        torch.testing.assert_close(queries.float().cpu(), expected, atol=1e-5, rtol=0)
    model(batch, strategy, parts.corpus, reader_only=False)
    if name == "frozen":  # a frozen retriever never moves: every step selects from the kept queries
        assert forwards == [4] and len(selected) == 3
        return
    # f moves at this step: the selection embeds in train mode, step 1 again with gradient from its random state
    assert forwards == [4, 4, 4] and model.query_cache.vectors == {}
    noisy = selected[-1].float().cpu()
    assert (noisy - expected).norm(dim=-1).max() > 0.05  # under the tower's dropout
    model(batch, strategy, parts.corpus, reader_only=True)
    assert forwards == [4, 4, 4, 4]  # embedded again after the retriever's step


def test_validation_answers_from_the_strategys_own_selection(step_world):
    """`validate(..., strategy=...)` reads the top passages of the training selection (here <q, h(B)> with a
    trained-looking h): the same ids as a top-k over h(B) by hand, reported as `dev_selection_*`, and nothing
    re-embedded (moving the passage tower changes the re-embedded figures only)."""
    from rlm.inference.evaluation import retrieval_metrics
    from rlm.training.validation import selection_retrieve, validate

    cfg, parts, model, strategy = make_parts(step_world)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.corrector.parameters():
            p.add_(0.2 * torch.randn_like(p))
    dev = parts.dev_examples[:6]
    queries = model.retriever.query_tower.encode([ex.question for ex in dev])
    got = selection_retrieve(strategy, model.corrector, parts.corpus, queries, 5)
    buffer = torch.cat([block.float() for _, block in parts.buffer.iter_chunks(len(parts.buffer))])
    with torch.no_grad():
        scores = queries @ model.corrector(buffer).T
    by_hand = [[parts.corpus.ids[r] for r in row] for row in scores.topk(5).indices.tolist()]
    assert got.ids == by_hand
    chosen = validate(model, parts.corpus, dev, cfg, strategy=strategy)
    assert {"dev_selection_exact_match", "dev_selection_f1", "dev_selection_recall@5"} <= set(chosen)
    assert all(key.startswith("dev_selection_") for key in chosen)
    recall = retrieval_metrics(parts.corpus, dev, got, [5])["recall@5"]
    assert chosen["dev_selection_recall@5"] == pytest.approx(recall, abs=1e-4)
    with torch.no_grad():
        for p in model.retriever.passage_tower.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert validate(model, parts.corpus, dev, cfg, strategy=strategy) == chosen


@pytest.mark.parametrize("name", ["corrector", "stale"])
def test_the_phases_are_timed_from_outside_the_step_in_the_papers_order(step_world, name):
    """The step's code holds no timer: the loop times the window's selection, and forward hooks on the model's
    parts (`PhaseTimer.attach`) lap each phase as its part ends, in the paper's order, each moment in one."""
    import inspect

    import rlm.training.steps
    from rlm.training.selection import select_window
    from rlm.training.throughput import PhaseTimer, step_phases

    assert "timer" not in inspect.getsource(rlm.training.steps)
    cfg, parts, model, strategy = make_parts(step_world, f"strategy.name={name}")
    timer = PhaseTimer(torch.device("cpu"))
    clock, phases = iter(range(1000)), []
    timer.mark = lambda: next(clock)  # a tick per mark
    add = timer.add
    timer.add = lambda phase, start, end: phases.append(phase) or add(phase, start, end)
    hooks = timer.attach(model, step_phases(model))
    batch = make_batch(parts.train_examples, [0, 1], parts.corpus, 2)
    with timer("select"):  # as the loop's accumulation window does
        (selection,) = select_window(model, [batch], strategy, parts.corpus, cfg)
    model(batch, strategy, parts.corpus, selection=selection)
    for hook in hooks:
        hook.remove()
    order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]  # a tower's buckets lap alike
    corrector = ["corrector"] if name == "corrector" else []  # the stale strategy has no h to run
    assert order == ["select", "retriever", "reader_scoring", "reader", *corrector, "losses"]
    assert sum(timer.take().values()) == 1 + (len(phases) - 1)  # select's tick, then one per lap
    model(batch, strategy, parts.corpus)  # detached: nothing more is timed
    assert timer.take() == {}


def test_a_strategy_selects_through_h_exactly_when_it_says_so(step_world):
    """The step passes h to the strategies that select through it (`uses_corrector`) and to no other: a stale
    strategy handed h, or the corrector strategy handed none, is a bug that fails loudly instead of selecting
    by the wrong scores."""
    cfg, parts, model, strategy = make_parts(step_world)
    stale = StaleStrategy(cfg.strategy, parts.buffer, 10)
    queries = torch.randn(3, parts.buffer.dim)
    with pytest.raises(ValueError, match="stale strategy selects without h"):
        stale.select(queries, model.corrector)
    with pytest.raises(ValueError, match="corrector strategy selects through h"):
        strategy.select(queries, None)


def test_the_step_reaches_the_corrected_top_k_through_the_strategys_select_alone(step_world, monkeypatch):
    """Algorithm 2's step 2 is `strategy.select(q, h)`, which runs `corrected_topk` itself: two calls from the
    window's selection to the top-k over h(B), whatever the placement (nothing between them to hide the idea)."""
    import inspect

    from rlm.training.strategies import base

    cfg, parts, model, strategy = make_parts(step_world)
    callers = []
    topk = base.corrected_topk

    def traced(*args, **kwargs):
        callers.append([frame.function for frame in inspect.stack()[1:3]])
        return topk(*args, **kwargs)

    monkeypatch.setattr(base, "corrected_topk", traced)
    model(make_batch(parts.train_examples, [0, 1], parts.corpus, 2), strategy, parts.corpus)
    assert callers == [["select", "select_window"]]


def test_a_later_micro_batch_is_selected_with_the_query_embedding_its_loss_uses(step_world):
    """The window's selection selects S_x for all its micro-batches at once, embedding their questions for it
    from the random state each one's step 1 then embeds them from again, so under the towers' dropout the q
    that selected a batch's passages is the q its retriever loss is computed with."""
    from rlm.training.selection import select_window

    cfg, parts, model, strategy = make_parts(step_world, "retriever.dropout=0.5")
    model.train()
    first, second = (make_batch(parts.train_examples, rows, parts.corpus, 2) for rows in ([0, 1], [2, 3]))
    selected, with_gradient = [], []
    select = strategy.select
    strategy.select = lambda queries, *a, **k: (
        selected.append(queries.detach().clone()) or select(queries, *a, **k)
    )
    encode = model.retriever.encode_queries

    def recording(questions):
        out = encode(questions)
        if torch.is_grad_enabled():
            with_gradient.append(out.detach().clone())
        return out

    model.retriever.encode_queries = recording
    selections = select_window(model, [first, second], strategy, parts.corpus, cfg)  # as the loop does
    model(first, strategy, parts.corpus, selection=selections[0])
    model(second, strategy, parts.corpus, selection=selections[1])
    assert (
        len(selected) == 1 and len(with_gradient) == 2
    )  # one selection for the window, each q with gradient
    assert torch.equal(selected[0][:2], with_gradient[0])
    assert torch.equal(selected[0][2:], with_gradient[1])  # the later batch: its loss's q selected its S_x
    again = encode(second.questions).detach()
    assert not torch.allclose(again, with_gradient[1])  # dropout is in force: another draw, another q


def test_a_slow_tokenizer_runs_on_the_background_thread_while_the_window_computes(step_world, monkeypatch):
    """Once the window's S_x is selected, each micro-batch's passages are tokenized on a background thread: with
    a collation that takes 0.4 s, the later micro-batch's reader inputs are ready before its step asks
    for them, because they were made while the first micro-batch computed (a sleep stands for that here), and
    the later step does not wait for them."""
    import threading
    import time

    from rlm.reader.formatting import FiDCollator
    from rlm.training.selection import select_window

    slow_s = 0.4
    cfg, parts, model, strategy = make_parts(step_world)
    model.train()
    first, second = (make_batch(parts.train_examples, rows, parts.corpus, 2) for rows in ([0, 1], [2, 3]))
    calls = []  # (thread name, end time) of each FiD collation
    collate = FiDCollator.__call__

    def slow(self, questions, passages, answers=None):
        out = collate(self, questions, passages, answers)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(slow_s)
        calls.append((threading.current_thread().name, time.perf_counter()))
        return out

    monkeypatch.setattr(FiDCollator, "__call__", slow)
    selections = select_window(model, [first, second], strategy, parts.corpus, cfg)
    model(first, strategy, parts.corpus, selection=selections[0])
    time.sleep(4 * slow_s)  # the first micro-batch's backward, and the second's steps 1-5, on a device
    asked = time.perf_counter()
    waited = model.inputs.waited_s
    model(second, strategy, parts.corpus, selection=selections[1])
    assert {name for name, _ in calls} == {
        "rlm-step-inputs_0"
    }  # scoring and FiD collations, all off the step
    # Both micro-batches' collations (one each: the FiD reader's, which the scoring pass's inputs are cut from)
    # ended before the second micro-batch's step began.
    assert len(calls) == 2 and all(end < asked for _, end in calls)
    assert model.inputs.waited_s - waited < slow_s  # it did not wait for the tokenizer's 0.4 s


def test_the_step_its_model_and_its_inputs_import_no_circle_even_for_types():
    """steps.py, model.py, step_inputs.py and what they share (batch.py, selection.py) import one another one
    way only, counting the imports made for type checkers alone (`if TYPE_CHECKING:`)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "rlm" / "training"
    names = ("steps", "model", "step_inputs", "batch", "selection", "loop")
    graph = {}
    for name in names:
        tree = ast.parse((folder / f"{name}.py").read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        graph[name] = {other for other in names if f"rlm.training.{other}" in found}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph[start])

    assert [name for name in names if reaches(name, name)] == [], graph
