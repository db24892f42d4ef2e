import subprocess
import sys
from importlib.metadata import version

import pytest

from rlm.cli import COMMANDS, build_parser, main


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_one_line_error(capsys):
    assert main(["no-such-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command" in err[0]


def test_help_does_not_import_torch():
    code = "import sys; from rlm.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_version_prints_the_installed_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlm {version('rlm-corrector')}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_help_shows_its_defaults(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: a default is never wrapped apart
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    parser, module = build_parser(name)
    assert not hasattr(module, "HELP")  # a command's one-line help is said once, in COMMANDS
    for action in parser._actions:
        takes_value = action.option_strings and action.nargs != 0
        if takes_value and action.default not in (None, []) and "default" not in (action.help or ""):
            assert action.help, f"rlm {name} {action.option_strings[0]} has a default but no help to show it"
            assert f"(default: {action.default})" in out, (name, action.option_strings)


def test_train_help_says_where_its_defaults_come_from(capsys):
    # `rlm train` has no option with a default value: its settings come from the config (and its defaults).
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "default" in capsys.readouterr().out


def test_the_command_line_is_the_product_alone(capsys):
    """Benchmarks and experiments live in scripts/bench (a checkout's lab, not installed): no `rlm bench`."""
    main(["--help"])
    out = capsys.readouterr().out
    assert "bench" not in COMMANDS and not [
        line for line in out.splitlines() if line.strip().startswith("bench")
    ]
