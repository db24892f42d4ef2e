"""The scripts in scripts/ as a library user meets them: importable side by side without shadowing anything."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from script_loader import load_script

from rlm.experiments.benchmarking import corrector_moving, overlap

ROOT = Path(__file__).resolve().parents[1]

LOAD_ALL_SCRIPTS = """
import importlib.util, sys
from pathlib import Path

scripts = Path(sys.argv[1])
before = list(sys.path)
for path in sorted(scripts.glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
added = [p for p in sys.path if p not in before]
assert str(scripts) not in sys.path, f"a script put {scripts} on sys.path"

import evaluate  # the library, not scripts/evaluate.py

assert hasattr(evaluate, "load"), f"`import evaluate` found {evaluate.__file__}"
print("ok", added)
"""


def test_loading_every_script_leaves_installed_packages_importable():
    # scripts/evaluate.py shares its name with the `evaluate` library: a script that puts scripts/ on sys.path
    # breaks `evaluate.load` for the rest of the process (CI failed this way with the metrics test after a
    # benchmark test had loaded bench_training in-process).
    out = subprocess.run(
        [sys.executable, "-c", LOAD_ALL_SCRIPTS, str(ROOT / "scripts")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


@pytest.mark.parametrize("move", [0.2, 1.0])
def test_benchmark_corrector_moves_unit_vectors_by_the_stated_amount(move):
    net = corrector_moving(64, 128, move, seed=3)
    assert not net.training
    probe = F.normalize(torch.randn(4096, 64, generator=torch.Generator().manual_seed(7)), dim=-1)
    with torch.no_grad():
        moved = (net(probe) - probe).norm(dim=-1).mean().item()
    assert moved == pytest.approx(move, rel=0.1)


def test_overlap_is_the_fraction_of_the_reference_found_per_query():
    reference = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    found = torch.tensor([[4, 3, 9, 9], [5, 6, 7, 8]])
    assert overlap(found, reference) == pytest.approx((0.5 + 1.0) / 2)


def test_bench_query_tower_times_the_full_and_a_light_tower_side_by_side(tmp_path):
    import json

    script = load_script("bench_query_tower")
    out = tmp_path / "bq"
    argv = ["--layers", "1", "--batch", "4", "--singles", "2", "--reps", "1", "--out", str(out)]
    assert script.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["layers"] for r in rows] == [6, 1]
    assert rows[0]["single_speedup"] == 1.0 and rows[1]["params_m"] < rows[0]["params_m"]
    assert all(r["single_ms"] > 0 and r["batch_ms_per_query"] > 0 for r in rows)
    assert "| layers:1 | 1 |" in out.with_suffix(".md").read_text()

    # Questions of the user's own data (a QA JSONL) instead of the toy world's.
    qa = tmp_path / "qa.jsonl"
    qa.write_text(
        json.dumps({"question": "Which river runs through the city of the 1936 games?", "answers": ["x"]})
    )
    assert script.questions(3, qa) == ["Which river runs through the city of the 1936 games?"] * 3
    assert script.main([*argv, "--questions", str(qa)]) == 0
    assert f"Questions from {qa}" in out.with_suffix(".md").read_text()


def test_selection_distractors_sorts_each_selected_passage_by_what_it_is(tmp_path):
    """The analysis behind docs/results/quickstart/quickstart.md: gold, a relative's fact about the subject, another fact
    of the subject, another entity's passage."""
    import json

    from rlm.data.corpus import load_corpus
    from rlm.data.qa import QAExample

    passages = [
        ("p0", "Ada Vel", "Ada Vel was born in Lyon."),
        ("p1", "Ada Vel", "Ada Vel's sister was born in Oslo."),
        ("p2", "Ada Vel", "Ada Vel works as a baker."),
        ("p3", "Bo Ren", "Bo Ren was born in Rome."),
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in passages))
    corpus = load_corpus(path)
    ex = QAExample("q0", "Where was Ada Vel born?", ["Lyon"], ["p0"], {"subject": "Ada Vel"})
    script = load_script("selection_distractors")
    got = script.composition(corpus, [ex, ex], [[0, 1, 2, 3], [1, 3, 2, 0]])
    assert got == {
        "gold@1": 0.5,
        "gold in top-K": 1.0,
        "relatives' facts": 1.0,
        "subject's other facts": 1.0,
        "other entities": 1.0,
    }
