import re
from pathlib import Path

import pytest

from rlm.config import TrainConfig, apply_override, dump_config, load_config
from rlm.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, TrainConfig) and cfg.strategy.name == "corrector" and cfg.corrector.weight == 10.0


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.strategy.k >= 1


def test_paper_configs_use_the_papers_settings():
    for name in ("nq", "tqa", "hotpotqa"):
        assert load_config(CONFIGS / f"{name}.yaml").strategy.name == "corrector"
        for strategy in ("corrector", "exhaustive", "frozen"):
            cfg = load_config(CONFIGS / f"{name}.yaml", [f"strategy.name={strategy}"])
            assert (
                cfg.output_dir == f"runs/{name}_{strategy}"
            )  # one file per dataset, a run folder per strategy
            assert cfg.strategy.name == strategy
            assert cfg.strategy.k == 32 and cfg.optim.max_steps == 20000 and cfg.corrector.weight == 10.0
            assert cfg.retriever.path == "sentence-transformers/gtr-t5-base" and cfg.reader.path == "t5-base"
            assert cfg.corrector.hidden_dim == 8192
            assert cfg.data.dev_subcorpus == "build" and cfg.eval_every == 2000
            assert_128_questions_per_step(cfg)
    alg1 = load_config(CONFIGS / "nq_alg1.yaml")
    assert alg1.output_dir == "runs/nq_alg1_corrector"
    assert alg1.algorithm == 1 and alg1.optim.max_steps == 40000 and alg1.corrector.hidden_dim == 8192
    assert alg1.strategy.k == 64 and alg1.strategy.num_random == 64 and alg1.strategy.share_across_batch
    assert_128_questions_per_step(alg1)
    assert load_config().strategy.snm_size == 1_000_000


def test_paper_configs_share_one_buffer_per_corpus_and_passage_tower():
    """configs/{nq,tqa,hotpotqa,nq_alg1}.yaml and every baseline of them name a buffer folder that holds the
    corpus and the tower in its name, and configs that share a folder embed the same corpus with the same
    tower (a mismatch would be refused by the fingerprints at load, but only after a wasted start)."""
    owners = {}
    for name in ("nq", "tqa", "hotpotqa", "nq_alg1"):
        for strategy in ("corrector", "exhaustive", "stale" if name == "nq_alg1" else "frozen"):
            cfg = load_config(CONFIGS / f"{name}.yaml", [f"strategy.name={strategy}"])
            folder = cfg.buffer.dir
            assert folder and Path(folder).parts[:2] == ("runs", "buffers"), (name, folder)
            assert Path(cfg.data.corpus).stem in folder and cfg.retriever.path.rsplit("/", 1)[-1] in folder
            what = (cfg.data.corpus, cfg.retriever.path, cfg.retriever.passage_max_length, cfg.buffer.dtype)
            owners.setdefault(folder, set()).add(what)
    assert all(len(what) == 1 for what in owners.values()), owners


def assert_128_questions_per_step(cfg):
    """The paper's 128 questions per optimizer step, whatever the number of processes that divides it."""
    for processes in (1, 2, 8):
        accum = cfg.optim.accumulation_steps(processes)
        assert accum * cfg.optim.batch_size * processes == 128, (processes, accum)


def test_questions_per_step_refuses_what_does_not_divide_or_contradicts():
    cfg = load_config(None, ["optim.questions_per_step=128", "optim.batch_size=4"])
    assert cfg.optim.accumulation_steps(8) == 4 and cfg.optim.accumulation_steps(1) == 32
    with pytest.raises(ValueError, match="not a multiple"):
        cfg.optim.accumulation_steps(3)
    cfg = load_config(
        None, ["optim.questions_per_step=128", "optim.batch_size=4", "optim.gradient_accumulation_steps=8"]
    )
    with pytest.raises(ValueError, match="contradicts"):
        cfg.optim.accumulation_steps(8)
    assert load_config(None, ["optim.gradient_accumulation_steps=3"]).optim.accumulation_steps(8) == 3


def test_shipped_launcher_configs_say_what_they_start():
    """accelerate starts several CPU processes only through torchrun (MULTI_GPU) or mpirun: a config with
    use_cpu true starts one, whatever its num_processes says."""
    import yaml

    cpu = yaml.safe_load((CONFIGS / "accelerate" / "cpu_2proc.yaml").read_text())
    assert cpu["num_processes"] == 2 and cpu["distributed_type"] == "MULTI_GPU" and not cpu["use_cpu"]
    ddp = yaml.safe_load((CONFIGS / "accelerate" / "ddp.yaml").read_text())
    assert ddp["distributed_type"] == "MULTI_GPU" and ddp["num_processes"] == 8


def test_overrides_are_parsed_as_yaml_and_nested():
    cfg = load_config(
        CONFIGS / "quickstart.yaml",
        ["strategy.name=exhaustive", "optim.lr_reader=3e-4", "data.dev=null", "strategy.refresh_every=7"],
    )
    assert cfg.strategy.name == "exhaustive" and cfg.optim.lr_reader == 3e-4
    assert cfg.data.dev is None and cfg.strategy.refresh_every == 7


def test_int_widens_to_float():
    assert load_config(None, ["beta=5"]).beta == 5.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("strategy.nmae=corrector", "did you mean name"),
        ("no_such_section.x=1", "unknown config key config.no_such_section"),
        ("optim.max_steps=many", "expected int"),
        ("strategy.name=bogus", "strategy.name must be one of"),
        ("gradient_checkpointing=3", "expected true/false"),
        ("corrector.loss=l1", "corrector.loss"),
    ],
)
def test_bad_keys_and_values_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_override_without_equals_is_refused():
    with pytest.raises(ValueError, match="key=value"):
        apply_override({}, "strategy.name")


def test_dump_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "quickstart.yaml", ["seed=3"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_mixed_precision_no_is_a_word_not_a_boolean(tmp_path):
    # YAML 1.1 reads `no` as False; the documented value of mixed_precision must load, in a file and in --set.
    assert load_config(None, ["mixed_precision=no"]).mixed_precision == "no"
    path = tmp_path / "run.yaml"
    path.write_text("mixed_precision: no\ncpu: true\n")
    cfg = load_config(path)
    assert cfg.mixed_precision == "no" and cfg.cpu is True
    with pytest.raises(ValueError, match="expected true/false"):
        load_config(None, ["cpu=yes"])


@pytest.mark.parametrize(
    "name", ["corrector", "stale", "exhaustive", "snm", "two_round", "frozen", "closed_book", "in_batch"]
)
def test_each_strategy_is_checked_by_what_its_class_says(name):
    """The config takes the strategy names, the algorithms each takes part in and whether two-stage search
    applies from the strategy classes themselves (no list of names repeated here)."""
    from rlm.training.strategies import STRATEGY_CLASSES

    cls = STRATEGY_CLASSES[name]
    for algorithm in (1, 2):
        overrides = [f"strategy.name={name}", f"algorithm={algorithm}"]
        if algorithm not in cls.algorithms:
            with pytest.raises(ValueError, match=f"only makes sense for algorithm {cls.algorithms[0]}"):
                load_config(None, overrides)
            continue
        assert load_config(None, overrides).strategy.name == name
        if cls.scans_fixed_buffer:
            assert load_config(None, [*overrides, "strategy.search=two_stage"]).strategy.search == "two_stage"
        else:
            with pytest.raises(ValueError, match="two_stage searches an index over the fixed buffer"):
                load_config(None, [*overrides, "strategy.search=two_stage"])
    assert cls.uses_corrector == (name == "corrector")
    assert cls.uses_passages == (name != "closed_book")


@pytest.mark.parametrize("name", ["gold_passage_steps", "reader_only_steps", "final_reader_only_steps"])
def test_the_schedule_has_its_own_section_and_old_keys_name_the_new_ones(name, tmp_path):
    cfg = load_config(None, [f"schedule.{name}=7"])
    assert getattr(cfg.schedule, name) == 7 and not hasattr(cfg.reader, name)
    with pytest.raises(ValueError, match=f"reader.{name} moved to schedule.{name}.*--set schedule.{name}=7"):
        load_config(None, [f"reader.{name}=7"])
    old = tmp_path / "old.yaml"
    old.write_text(f"reader:\n  d_model: 64\n  {name}: 7\n")
    with pytest.raises(ValueError, match=f"reader.{name} moved to schedule.{name}"):
        load_config(old)
    # A run's own config.yaml written before the move still loads: the key is moved, not refused.
    saved = load_config(old, saved=True)
    assert getattr(saved.schedule, name) == 7 and saved.reader.d_model == 64
    with pytest.raises(ValueError, match=f"schedule.{name} must be >= 0"):
        load_config(None, [f"schedule.{name}=-1"])


def test_values_are_checked_when_the_config_is_validated_not_when_a_section_is_built():
    from rlm.config import ReaderConfig

    ReaderConfig(arch="nonsense")  # a section alone is plain data
    with pytest.raises(ValueError, match="reader.arch must be one of"):
        load_config(None, ["reader.arch=nonsense"])


def test_the_old_per_strategy_config_names_say_what_replaced_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"configs/nq.yaml --set strategy.name=exhaustive"):
        load_config("configs/nq_exhaustive.yaml")
    with pytest.raises(ValueError, match=r"configs/nq_alg1.yaml --set strategy.name=corrector"):
        load_config("nq_alg1_corrector")


@pytest.mark.parametrize(
    "override, message",
    [
        ("keep_last=-1", "keep_last must be >= 1, got -1"),  # would delete the checkpoint just written
        ("keep_last=0", "keep_last must be >= 1"),
        ("log_every=0", "log_every must be >= 1"),  # was a ZeroDivisionError after the buffer build
        ("optim.lr_reader=.nan", "optim.lr_reader must be a finite number >= 0, got nan"),
        ("optim.lr_retriever=nan", "optim.lr_retriever must be a finite number"),
        ("optim.lr_corrector=-1e-3", "optim.lr_corrector must be a finite number >= 0"),
        ("beta=0", "beta must be a finite number > 0"),
        ("reader_temperature=0", "reader_temperature must be a finite number > 0"),
        ("reader_temperature=.inf", "reader_temperature must be a finite number > 0, got inf"),
        (
            "retriever.collapse_cosine=.nan",
            r"collapse_cosine must be a finite number in \(-1, 1\] \(or null\)",
        ),
        ("data.max_dev_examples=0", r"data.max_dev_examples must be >= 1 \(or null\)"),
        ("seed=-1", r"seed must be in \[0, 4294967295\]"),
    ],
)
def test_bad_numbers_are_refused_when_the_config_loads(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


def test_every_numeric_setting_has_a_range_and_nan_is_in_none():
    """A numeric field added to any section without a range fails here, and each range is enforced: the value
    just below it and NaN are refused naming the key (an int field refuses NaN as not an int)."""
    from rlm.config import NUMERIC_RANGES, numeric_fields

    assert {name for name, _ in numeric_fields(TrainConfig)} == set(NUMERIC_RANGES)
    assert {"beta", "optim.lr_reader", "strategy.regression.ridge", "data.toy_world.seed"} <= set(
        NUMERIC_RANGES
    )
    for name, interval in NUMERIC_RANGES.items():
        low = interval[1:].split(",")[0]
        below = str(int(low) - 1 if interval[0] == "[" else int(low))
        for value in (below, ".nan"):
            with pytest.raises(UserError, match=rf"{re.escape(name)}\b.*(must be|expected int|does not fit)"):
                load_config(None, [f"{name}={value}"])
