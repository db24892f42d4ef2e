"""User-facing CLI errors: one readable line on stderr that says what is wrong and how to fix it, exit 2."""

from __future__ import annotations

import json

import pytest

from rlm.cli import COMMANDS, main


def one_error_line(capsys) -> str:
    """The single `error: ...` line, last on stderr (progress bars of model loading may come before it)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error")]
    assert len(errors) == 1 and err[-1] == errors[0], err
    assert "Traceback" not in "\n".join(err)
    return errors[0]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_help_lists_the_product_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("quickstart", "embed", "index", "train", "evaluate", "demo", "calibrate"):
        assert name in COMMANDS
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 10  # a one-line help, not just the name


@pytest.mark.parametrize("command", ["demo", "evaluate"])
def test_missing_checkpoint_folder(command, tmp_path, capsys):
    missing = tmp_path / "runs" / "nothing" / "final"
    extra = []
    if command == "evaluate":
        questions = write_jsonl(tmp_path / "q.jsonl", [{"question": "what?", "answers": ["a"]}])
        extra = ["--dataset", "jsonl", "--data-path", questions, "--closed-book"]
    assert main([command, "--checkpoint", str(missing), *extra]) == 2
    line = one_error_line(capsys)
    assert "not found" in line and str(missing) in line


def test_demo_missing_checkpoint_says_how_to_make_one(tmp_path, capsys):
    assert main(["demo", "--checkpoint", str(tmp_path / "x")]) == 2
    assert "rlm quickstart --no-serve" in one_error_line(capsys)


def test_checkpoint_without_its_parts(tmp_path, capsys):
    (tmp_path / "final").mkdir()
    assert main(["demo", "--checkpoint", str(tmp_path / "final")]) == 2
    line = one_error_line(capsys)
    assert "retriever" in line and "rlm train" in line


def test_hub_model_while_offline_points_to_the_packaged_default(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "1", "title": "A", "text": "alpha"}])
    argv = [
        "embed",
        "--corpus",
        corpus,
        "--out",
        str(tmp_path / "buf"),
        "--encoder",
        "sentence-transformers/gtr-t5-base",
    ]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert "sentence-transformers/gtr-t5-base" in line
    assert "packaged default" in line and "local sentence-transformers folder" in line


def test_buffer_built_for_another_corpus_is_refused(tmp_path, capsys):
    corpus_a = write_jsonl(
        tmp_path / "a.jsonl", [{"id": str(i), "title": "T", "text": f"passage {i}"} for i in range(3)]
    )
    corpus_b = write_jsonl(
        tmp_path / "b.jsonl", [{"id": str(i), "title": "T", "text": f"other text {i}"} for i in range(3)]
    )
    questions = write_jsonl(tmp_path / "q.jsonl", [{"question": "what?", "answers": ["passage"]}] * 4)
    assert (
        main(
            [
                "embed",
                "--corpus",
                corpus_a,
                "--out",
                str(tmp_path / "buf"),
                "--no-progress",
                "--max-length",
                "128",
            ]
        )
        == 0
    )
    capsys.readouterr()
    overrides = [
        f"data.corpus={corpus_b}",
        f"data.train={questions}",
        "data.dev=null",
        f"buffer.dir={tmp_path / 'buf'}",
        f"output_dir={tmp_path / 'run'}",
        "optim.max_steps=1",
        "optim.batch_size=2",
    ]
    argv = ["train"]
    for assignment in overrides:
        argv += ["--set", assignment]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert "corpus fingerprint" in line and "rlm embed" in line


def test_unknown_config_key_suggests_the_right_one(capsys):
    assert main(["quickstart", "--no-serve", "--set", "optim.max_stepz=3"]) == 2
    line = one_error_line(capsys)
    assert "optim.max_stepz" in line and "max_steps" in line


def test_quickstart_without_dev_set_is_refused_before_training(tmp_path, capsys):
    argv = ["quickstart", "--no-serve", "--output-dir", str(tmp_path / "qs"), "--set", "data.dev=null"]
    assert main(argv) == 2
    assert "data.dev" in one_error_line(capsys)
    assert not (tmp_path / "qs" / "final").exists()


def test_a_bug_keeps_its_traceback_and_an_unknown_passage_id_is_one_line(tmp_path, capsys, monkeypatch):
    """A KeyError from our own code is a bug: the CLI lets it through with its traceback. An id the user's
    data names but the corpus lacks (`UnknownPassageError`, a KeyError) is the user's mistake: one line."""
    import rlm.commands.evaluate as evaluate_command
    from rlm.data.corpus import UnknownPassageError, load_corpus

    def bug(args):
        return {}["missing"]

    monkeypatch.setattr(evaluate_command, "run", bug)
    with pytest.raises(KeyError, match="missing"):
        main(["evaluate", "--checkpoint", str(tmp_path)])

    corpus = load_corpus(write_jsonl(tmp_path / "c.jsonl", [{"id": "1", "title": "A", "text": "alpha"}]))
    with pytest.raises(UnknownPassageError) as caught:
        corpus.index_of("nope")
    assert isinstance(caught.value, KeyError) and str(caught.value).startswith("passage id 'nope' not in")

    def users_data(args):
        corpus.index_of("nope")

    monkeypatch.setattr(evaluate_command, "run", users_data)
    assert main(["evaluate", "--checkpoint", str(tmp_path)]) == 2
    assert one_error_line(capsys) == f"error: passage id 'nope' not in {tmp_path / 'c.jsonl'}"


def test_a_valueerror_from_our_code_is_a_bug_and_user_errors_of_each_package_are_one_line(
    tmp_path, capsys, monkeypatch
):
    """Only the packages' user-error types (`rlm.errors.user_errors()`) become one line; a plain ValueError, such
    as a helper called with mismatched lists by our own code, is a bug and keeps its traceback."""
    import rlm.commands.evaluate as evaluate_command
    from rlm.errors import UserError
    from rlm.inference.metrics import qa_scores
    from rlm.reader.errors import InputError as ReaderInputError
    from rlm.retriever.errors import InputError as RetrieverInputError

    def bug(args):
        return qa_scores(["a"], [["a"], ["b"]])

    monkeypatch.setattr(evaluate_command, "run", bug)
    with pytest.raises(ValueError, match="1 predictions but 2 answer lists") as caught:
        main(["evaluate", "--checkpoint", str(tmp_path)])
    assert type(caught.value) is ValueError
    assert capsys.readouterr().err == ""

    for error in (UserError, ReaderInputError, RetrieverInputError):
        assert issubclass(error, ValueError)  # callers that catch ValueError keep working

        def users_mistake(args, error=error):
            raise error(f"{error.__module__}: what to change")

        monkeypatch.setattr(evaluate_command, "run", users_mistake)
        assert main(["evaluate", "--checkpoint", str(tmp_path)]) == 2
        assert one_error_line(capsys) == f"error: {error.__module__}: what to change"


def test_a_config_that_is_not_yaml_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  max_steps: [1, 2\nseed: 0\n")
    assert main(["train", "--config", str(bad)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {bad}: not valid YAML") and "line" in line
    assert main(["train", "--set", "optim.max_steps=[1,"]) == 2
    assert one_error_line(capsys).startswith("error: --set optim.max_steps=[1,: the value is not valid YAML")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_a_launcher_only_the_main_process_says_why_and_the_others_give_it_time_to(
    rank, capsys, monkeypatch
):
    """Every process of a launched run meets the same bad setting. The main one prints the line and exits; the
    others exit quietly, but only after a grace period: the launcher ends every process once one has failed,
    so a quiet process that exited first could end the main one before its line was out (seen under load)."""
    import rlm.cli

    waits = []
    monkeypatch.setattr(rlm.cli.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", rank)
    assert main(["train", "--set", "strategy.name=nonsense"]) == 2
    if rank == "0":
        assert "nonsense" in one_error_line(capsys) and waits == []
    else:
        assert capsys.readouterr().err == "" and waits == [rlm.cli.QUIET_RANK_GRACE_S]
