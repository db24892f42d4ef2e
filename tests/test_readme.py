"""What the README (and docs/demo.md, where its demo details went) shows a new user exists in what they will have:
every command in a code block parses with the CLI it names and every file, config, extra and make target it
names is there; every question it quotes is a dev question of the world `make demo` generates (seed 0), so
the demo answers it from a passage about that person; its results table is the one in scripts/bench/reports."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from rlm.cli import build_parser
from rlm.data.toy_world import build_toy_world
from rlm.quickstart.pipeline import quickstart_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS_WITH_COMMANDS = (README, ROOT / "docs" / "demo.md")


def shell_commands(path: Path) -> list[list[str]]:
    """Each command of the file's bash code blocks as argv: continuations joined, comments dropped, `&&` split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1 :]
    return commands


def parses(command: str, argv: list[str]) -> None:
    parser, _ = build_parser(command)
    try:
        parser.parse_args(argv)
    except SystemExit as err:
        pytest.fail(f"`rlm {command} {shlex.join(argv)}` does not parse (exit {err.code})")


@pytest.mark.parametrize("doc", DOCS_WITH_COMMANDS, ids=lambda p: p.name)
def test_every_command_shown_runs_something_that_exists(doc):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; pyproject.toml allows 3.10
    makefile = (ROOT / "Makefile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    commands = shell_commands(doc)
    assert commands, f"{doc.name} shows no command"
    for argv in commands:
        program, args = argv[0], argv[1:]
        if program == "rlm":
            if args[0] not in ("--help", "--version"):
                parses(args[0], args[1:])
        elif program == "make":
            target = args[0]
            assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"no make target {target}"
        elif program == "accelerate":
            launcher = args[args.index("--config_file") + 1]
            assert (ROOT / launcher).is_file(), launcher
            module = args.index("-m")
            if args[module + 1] == "rlm":  # `-m rlm evaluate ...`: any command, data-parallel
                parses(args[module + 2], args[module + 3 :])
            else:
                assert args[module + 1] == "rlm.train"
                parses("train", args[module + 2 :])
        elif program == "pip":
            for extra in re.findall(r"\.\[([\w,]+)\]", " ".join(args)):
                assert set(extra.split(",")) <= set(extras), f"pip extra [{extra}] is not in pyproject.toml"
        elif program in ("python", "python3") and args[0].startswith("scripts/"):
            assert (ROOT / args[0]).is_file(), args[0]
    for config in re.findall(r"\bconfigs/[\w/.-]+\.(?:yaml|sbatch)", doc.read_text()):
        assert (ROOT / config).is_file(), f"{doc.name} names {config}, which does not exist"


@pytest.mark.parametrize("doc", DOCS_WITH_COMMANDS, ids=lambda p: p.name)
def test_links_and_images_exist(doc):
    for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_readme_stays_a_front_page():
    # Issue 30: the README is what a newcomer reads first; details belong in docs/.
    assert len(README.read_text().splitlines()) <= 160


def test_docs_are_prose_a_newcomer_reads():
    """Issue 49: docs/ holds pages to read, at most 6,000 lines of text; reports and raw results live with their
    benchmarks in scripts/bench/reports/, which the pages link to."""
    texts = [p for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix != ".png"]
    assert all(p.suffix == ".md" for p in texts), [str(p) for p in texts if p.suffix != ".md"]
    assert sum(len(p.read_text().splitlines()) for p in texts) <= 6000
    for page in texts:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_readme_results_are_those_of_the_quickstart_report():
    text = README.read_text()
    source = (ROOT / "scripts" / "bench" / "reports" / "quickstart" / "quickstart.md").read_text()
    assert "scripts/bench/reports/quickstart/quickstart.md" in text
    seeds = re.findall(r"\d+\.\d / \d+\.\d / \d+\.\d", text)
    assert len(seeds) >= 5, "the README's toy-world table lost its per-seed figures"
    for figures in seeds:
        assert figures in source, (
            f"README figures {figures} are not in scripts/bench/reports/quickstart/quickstart.md"
        )


def test_questions_quoted_in_the_docs_are_in_the_quickstart_world(tmp_path):
    quoted = [q for doc in DOCS_WITH_COMMANDS for q in re.findall(r'qa\.answer\("([^"]+)"', doc.read_text())]
    assert quoted, "the docs' QAService example quotes no question"
    world = quickstart_config(None, str(tmp_path), []).data.toy_world
    paths = build_toy_world(
        tmp_path / "world", num_passages=world.num_passages, seed=world.seed, **world.options
    )
    dev = {row["question"]: row for row in map(json.loads, Path(paths.split("dev")).read_text().splitlines())}
    passages = {row["id"]: row for row in map(json.loads, Path(paths.corpus).read_text().splitlines())}
    for question in quoted:
        assert question in dev, f"quoted question {question!r} is not in the quickstart's dev set"
        golds = [passages[pid] for pid in dev[question]["gold_passage_ids"]]
        assert golds and all(gold["title"] in question for gold in golds)  # a passage about that person
        assert any(a in gold["text"] for gold in golds for a in dev[question]["answers"])
