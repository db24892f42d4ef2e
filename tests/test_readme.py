"""What the README shows a new user exists in what they will have: every question it quotes is a dev question
of the world `make demo` generates (seed 0), so the demo answers it from a passage about that person."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rlm.data.toy_world import build_toy_world
from rlm.quickstart.pipeline import quickstart_config

ROOT = Path(__file__).resolve().parents[1]


def test_questions_quoted_in_the_readme_are_in_the_quickstart_world(tmp_path):
    quoted = re.findall(r'qa\.answer\("([^"]+)"', (ROOT / "README.md").read_text())
    assert quoted, "the README's QAService example quotes no question"
    world = quickstart_config(None, str(tmp_path), []).data.toy_world
    paths = build_toy_world(
        tmp_path / "world", num_passages=world.num_passages, seed=world.seed, **world.options
    )
    dev = {row["question"]: row for row in map(json.loads, Path(paths.split("dev")).read_text().splitlines())}
    passages = {row["id"]: row for row in map(json.loads, Path(paths.corpus).read_text().splitlines())}
    for question in quoted:
        assert question in dev, f"README question {question!r} is not in the quickstart's dev set"
        golds = [passages[pid] for pid in dev[question]["gold_passage_ids"]]
        assert golds and all(gold["title"] in question for gold in golds)  # a passage about that person
        assert any(a in gold["text"] for gold in golds for a in dev[question]["answers"])
