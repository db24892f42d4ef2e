import re
from dataclasses import replace
from pathlib import Path

import pytest

from rlm.config import TrainConfig, apply_override, dump_config, field_range, from_dict, load_config, to_dict
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
            assert cfg.final_embeddings == f"runs/{name}_{strategy}/embeddings"  # inside it, for `rlm index`
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
def test_the_schedule_has_its_own_section(name):
    cfg = load_config(None, [f"schedule.{name}=7"])
    assert getattr(cfg.schedule, name) == 7 and not hasattr(cfg.reader, name)
    with pytest.raises(ValueError, match=f"unknown config key config.reader.{name}"):
        load_config(None, [f"reader.{name}=7"])
    with pytest.raises(ValueError, match=f"schedule.{name} must be >= 0"):
        load_config(None, [f"schedule.{name}=-1"])


def test_values_are_checked_when_the_config_is_loaded_not_when_a_section_is_built():
    from rlm.config import ReaderConfig

    ReaderConfig(arch="nonsense")  # a section alone is plain data
    with pytest.raises(ValueError, match="reader.arch must be one of"):
        load_config(None, ["reader.arch=nonsense"])


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


def numeric_settings():
    """(dotted key, field, may be null) of every int or float setting, in every section."""
    import types
    import typing

    from rlm.config import settings

    found = []
    for key, each, tp in settings():
        args = set(typing.get_args(tp)) if typing.get_origin(tp) in (typing.Union, types.UnionType) else {tp}
        if args - {type(None)} and args - {type(None)} <= {int, float}:
            found.append((key, each, type(None) in args))
    return found


def test_each_range_is_written_beside_its_setting_not_in_a_table():
    """Every numeric field carries its range in its own metadata (`setting(default, ge=..)`), so a reader sees
    it next to the field; no table of ranges as strings is kept elsewhere."""
    import rlm.config
    from rlm.config import Interval

    numeric = {key: field_range(each) for key, each, _ in numeric_settings()}
    assert len(numeric) == 69 and all(isinstance(r, Interval) for r in numeric.values()), [
        key for key, r in numeric.items() if r is None
    ]
    assert str(numeric["beta"]) == "(0, inf)" and str(numeric["seed"]) == "[0, 4294967295]"
    assert (
        str(numeric["retriever.collapse_cosine"]) == "(-1, 1]"
        and str(numeric["reader.dropout_rate"]) == "[0, 1)"
    )
    assert not hasattr(rlm.config, "NUMERIC_RANGES") and not hasattr(rlm.config, "_INTERVAL")


def test_every_numeric_setting_has_a_range_and_nan_is_in_none():
    """A numeric field added to any section without a range fails here, and each range is enforced: the value
    just below it and NaN are refused naming the key (an int field refuses NaN as not an int)."""
    for name, each, _ in numeric_settings():
        interval = field_range(each)
        below = interval.low - 1 if interval.low_included else interval.low
        for value in (f"{below:g}", ".nan"):
            with pytest.raises(UserError, match=rf"{re.escape(name)}\b.*(must be|expected int|does not fit)"):
                load_config(None, [f"{name}={value}"])


def test_setting_takes_one_bound_of_each_side():
    from rlm.config import Interval, setting

    assert setting(1, ge=0, lt=1).metadata["range"] == Interval(0, 1, low_included=True, high_included=False)
    with pytest.raises(TypeError, match="one lower bound"):
        setting(1, ge=0, gt=0)


def choice_fields(cls=TrainConfig, prefix=""):
    """(dotted name, choices) of every field annotated with a Literal, in every section."""
    import dataclasses
    import typing

    found = []
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            found += choice_fields(tp, f"{prefix}{name}.")
        elif typing.get_origin(tp) is typing.Literal:
            found.append((f"{prefix}{name}", typing.get_args(tp)))
    return found


def test_every_choice_is_refused_outside_its_literal_naming_key_value_and_choices():
    fields = dict(choice_fields())
    assert {"strategy.name", "reader.arch", "report_to", "mixed_precision", "buffer.placement"} <= set(fields)
    for name, choices in fields.items():
        for choice in choices:  # each choice passes the loader (the cross-field rules are validate()'s)
            data = {}
            apply_override(data, f"{name}={choice}")
            from_dict(TrainConfig, data)
        listed = re.escape(", ".join(map(str, choices)))
        with pytest.raises(UserError, match=rf"^{re.escape(name)} must be one of {listed}; got 'bogus'$"):
            load_config(None, [f"{name}=bogus"])
    with pytest.raises(
        UserError, match=r"strategy.name must be .*; got 'corector' \(did you mean corrector\?\)"
    ):
        load_config(None, ["strategy.name=corector"])
    # The type counts: YAML's true equals 1 and 2.0 equals 2, but neither is an algorithm.
    for value in ("true", "2.0"):
        with pytest.raises(UserError, match="algorithm must be one of 1, 2"):
            load_config(None, [f"algorithm={value}"])


def test_the_config_names_what_the_strategy_registry_kernels_and_dtypes_name():
    """The choices in rlm.config are literals (loading a config imports neither the training code nor the
    retriever); here they are held equal to the registries they mirror. A strategy's facts are not mirrored:
    its class reads them from rlm.config (next test)."""
    import typing

    from rlm.config import STRATEGY_FACTS, StrategyName
    from rlm.retriever.buffer import DTYPES
    from rlm.retriever.reencode import KERNELS
    from rlm.training.strategies import STRATEGY_CLASSES

    assert list(typing.get_args(StrategyName)) == list(STRATEGY_FACTS) == list(STRATEGY_CLASSES)
    fields = dict(choice_fields())
    assert fields["strategy.regression.kernel"] == tuple(KERNELS)
    assert set(fields["buffer.dtype"]) == set(DTYPES)


def test_a_strategys_facts_are_read_from_one_table_by_its_class_and_the_config(monkeypatch):
    """Changing a strategy's row of rlm.config.STRATEGY_FACTS changes its class and what the config accepts:
    there is no second copy of the facts to keep equal."""
    import dataclasses

    from rlm.config import STRATEGY_FACTS
    from rlm.training.strategies import STRATEGY_CLASSES

    for name, cls in STRATEGY_CLASSES.items():
        facts = dataclasses.asdict(STRATEGY_FACTS[name])
        facts.pop("algorithms_reason")
        assert {key: getattr(cls, key) for key in facts} == facts, name
    stale = STRATEGY_CLASSES["stale"]
    assert stale.scans_fixed_buffer and not stale.uses_corrector and stale.algorithms == (1, 2)
    monkeypatch.setitem(
        STRATEGY_FACTS,
        "stale",
        dataclasses.replace(
            STRATEGY_FACTS["stale"], scans_fixed_buffer=False, uses_corrector=True, algorithms=(2,)
        ),
    )
    assert stale.uses_corrector and not stale.scans_fixed_buffer and stale.algorithms == (2,)
    with pytest.raises(UserError, match="two_stage searches an index over the fixed buffer"):
        load_config(None, ["strategy.name=stale", "strategy.search=two_stage"])
    with pytest.raises(UserError, match="'stale' only makes sense for algorithm 2"):
        load_config(None, ["strategy.name=stale", "algorithm=1"])


def test_loading_a_config_imports_no_training_code_and_of_the_retriever_only_its_errors():
    import subprocess
    import sys

    code = (
        "import sys; from rlm.config import load_config; "
        "load_config('nq', ['strategy.search=two_stage', 'strategy.regression.kernel=linear']); "
        "print(sorted(m for m in sys.modules if m.startswith(('rlm.training', 'rlm.retriever'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert (
        out.strip() == "['rlm.retriever', 'rlm.retriever.errors', 'rlm.retriever.index_spec']"
    )  # rlm.errors names the retriever's InputError; strategy.two_stage is the retriever's IndexSpec


@pytest.mark.parametrize("entry", ["-m rlm.train", "-m rlm train"])
def test_a_bad_setting_fails_before_the_training_code_is_imported(entry, tmp_path):
    """`python -m rlm.train` (each rank of `accelerate launch -m rlm.train`) and `rlm train` read the config
    before torch and transformers (~8 CPU-s a process): a bad setting is one line, at once, and nothing is
    written."""
    import subprocess
    import sys

    module = entry.split()[1]
    argv = (["train"] if module == "rlm" else []) + ["--set", "strategy.name=nonsense"]
    argv += ["--set", f"output_dir={tmp_path / 'run'}"]
    code = f"""
import runpy, sys
sys.argv = [{module!r}, *{argv!r}]
try:
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)  # what `python -m` does
except SystemExit as stop:
    print(stop.code, "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr[-2000:])
    assert done.stderr.startswith("error: strategy.name must be one of") and "nonsense" in done.stderr
    assert not (tmp_path / "run").exists()


def test_every_default_is_in_its_range():
    """The loader checks the values a config gives; the defaults it does not give are checked here."""
    from functools import reduce

    cfg = TrainConfig()
    for name, each, optional in numeric_settings():
        field_range(each).check(name, reduce(getattr, name.split("."), cfg), optional)


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "options":
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# What each shipped paper config sets, written out (every other key keeps its default): the configs that
# extend configs/base_gpu.yaml load to what they did as one file each.
PAPER_RLM = {
    "mixed_precision": "bf16",
    "gradient_checkpointing": True,
    "log_every": 50,
    "eval_every": 2000,
    "save_every": 1000,
    "data.corpus": "psgs_w100.tsv",
    "data.dev_split": "dev",
    "data.max_dev_examples": 2000,
    "data.dev_subcorpus": "build",
    "retriever.path": "sentence-transformers/gtr-t5-base",
    "retriever.passage_max_length": 256,
    "retriever.gradient_checkpointing": True,
    "reader.path": "t5-base",
    "reader.max_passage_length": 256,
    "reader.max_answer_length": 32,
    "buffer.dir": "runs/buffers/psgs_w100-gtr-t5-base",
    "buffer.batch_size": 512,
    "corrector.hidden_dim": 8192,
    "optim.lr_reader": 1e-4,
    "optim.lr_retriever": 1e-5,
    "optim.lr_corrector": 1e-4,
    "optim.warmup_steps": 1000,
    "optim.max_steps": 20000,
    "optim.questions_per_step": 128,
    "optim.batch_size": 4,
}
SHIPPED = {
    **{
        name: {
            **PAPER_RLM,
            "output_dir": f"runs/{name}_corrector",
            "final_embeddings": f"runs/{name}_corrector/embeddings",
            "data.train": data,
            "data.dev": data,
        }
        for name, data in (("nq", "nq_open"), ("tqa", "trivia_qa"), ("hotpotqa", "hotpot_qa"))
    },
    "nq_alg1": {
        "algorithm": 1,
        "output_dir": "runs/nq_alg1_corrector",
        "mixed_precision": "bf16",
        "log_every": 50,
        "save_every": 1000,
        "data.corpus": "psgs_w100.tsv",
        "data.train": "nq_train_gold.jsonl",
        "data.dev": None,
        "retriever.path": "sentence-transformers/gtr-t5-base",
        "retriever.passage_max_length": 256,
        "retriever.gradient_checkpointing": True,
        "buffer.dir": "runs/buffers/psgs_w100-gtr-t5-base",
        "buffer.batch_size": 512,
        "corrector.hidden_dim": 8192,
        "strategy.k": 64,
        "strategy.num_random": 64,
        "strategy.share_across_batch": True,
        "optim.lr_retriever": 1e-5,
        "optim.lr_corrector": 1e-4,
        "optim.warmup_steps": 1000,
        "optim.max_steps": 40000,
        "optim.questions_per_step": 128,
        "optim.batch_size": 16,
    },
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_paper_config_loads_to_its_written_out_settings(name):
    defaults = flat(to_dict(TrainConfig()))
    assert set(SHIPPED[name]) <= set(defaults)
    assert flat(to_dict(load_config(name))) == {**defaults, **SHIPPED[name]}


def test_a_users_config_extends_a_base_file_key_by_key(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "common.yaml").write_text(
        "seed: 3\noptim:\n  max_steps: 50\n  batch_size: 2\ndata:\n  dev: null\n"
    )
    (tmp_path / "mine" / "run.yaml").write_text("base: ../common.yaml\noptim:\n  max_steps: 7\n")
    cfg = load_config(tmp_path / "mine" / "run.yaml", ["optim.batch_size=5"])
    assert cfg.seed == 3 and cfg.data.dev is None  # from the base
    assert cfg.optim.max_steps == 7  # the extending file wins, key by key within a section
    assert cfg.optim.batch_size == 5  # --set wins over both
    # A base may be a shipped config's name, and bases chain (nq extends base_gpu).
    (tmp_path / "nq_short.yaml").write_text("base: nq\noutput_dir: runs/short\noptim:\n  max_steps: 10\n")
    short = load_config(tmp_path / "nq_short.yaml")
    assert short == replace(
        load_config("nq"), output_dir="runs/short", optim=replace(load_config("nq").optim, max_steps=10)
    )


def test_a_base_cycle_or_a_missing_base_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\nseed: 1\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nseed: 2\n")
    with pytest.raises(UserError, match=r"extend each other in a cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "self.yaml").write_text("base: self.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        load_config(tmp_path / "self.yaml")
    (tmp_path / "lost.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(UserError, match=r"lost.yaml: base nowhere.yaml not found"):
        load_config(tmp_path / "lost.yaml")
    with pytest.raises(UserError, match="unknown config key config.base"):
        load_config(None, ["base=nq"])  # a file says what it extends, not the command line


def test_a_renamed_setting_in_an_old_config_is_read_under_its_new_name_with_one_warning(tmp_path):
    from rlm.config import RenamedSettingWarning
    from rlm.training.checkpointing import changed_settings

    old = tmp_path / "old.yaml"
    old.write_text("max_nonfinite_in_a_row: 3\n")
    with pytest.warns(RenamedSettingWarning, match="max_nonfinite_in_a_row is now max_bad_batches") as seen:
        cfg = load_config(old)
    assert len(seen) == 1 and cfg.max_bad_batches == 3
    with pytest.warns(RenamedSettingWarning):
        assert load_config(None, ["max_nonfinite_in_a_row=4"]).max_bad_batches == 4
    with pytest.raises(UserError, match="max_nonfinite_in_a_row is the old name of max_bad_batches"):
        load_config(old, ["max_bad_batches=5"])
    # A checkpoint whose config.yaml has the old key resumes without a "changed setting": it is operational.
    saved = dump_config(cfg).replace("max_bad_batches:", "max_nonfinite_in_a_row:")
    assert "max_nonfinite_in_a_row: 3" in saved
    assert changed_settings(saved, dump_config(cfg), 1, 1) == {}
