"""An output folder of a command (`--out`, `--save-index`) that holds files the command did not write is refused
and left as it was: `rlm index --out runs/x` used to replace the run with an index. The command's own earlier
output is still rebuilt, or resumed where the command resumes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlm.cli import main
from rlm.retriever.buffer import PassageBuffer


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def run_folder(tmp_path):
    """What a training run leaves: files and folders no output command writes."""
    run = tmp_path / "runs" / "x"
    (run / "final").mkdir(parents=True)
    (run / "final" / "weights.safetensors").write_bytes(b"weights")
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.json").write_text('{"exact_match": 0.5}\n')
    return run


def contents(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_index_refuses_a_folder_of_something_else_and_rebuilds_its_own(tmp_path, run_folder, capsys):
    np.save(tmp_path / "emb.npy", np.eye(3, dtype=np.float32))
    (tmp_path / "ids.txt").write_text("a\nb\nc\n")
    argv = ["index", "--embeddings", str(tmp_path / "emb.npy"), "--ids", str(tmp_path / "ids.txt"), "--out"]
    before = contents(run_folder)
    assert main([*argv, str(run_folder)]) == 2
    line = one_error_line(capsys)
    assert str(run_folder) in line and "config.yaml, final/, metrics.json" in line
    assert "`rlm index` did not write" in line and "empty folder" in line
    assert contents(run_folder) == before
    # A file is no index folder either (it used to be replaced by one).
    (tmp_path / "notes.txt").write_text("mine")
    assert main([*argv, str(tmp_path / "notes.txt")]) == 2
    assert "is a file" in one_error_line(capsys)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # A new folder, an empty one, and the index's own folder again.
    (tmp_path / "empty").mkdir()
    for out in ("idx", "empty", "idx"):
        assert main([*argv, str(tmp_path / out)]) == 0
        assert sorted(p.name for p in (tmp_path / out).iterdir()) == ["ids.txt", "index.faiss", "index.json"]


def test_evaluate_refuses_out_and_save_index_folders_of_something_else(tmp_path, run_folder, capsys):
    """Checked before anything loads: `--out runs/x` would overwrite the run's metrics.json."""
    before = contents(run_folder)
    base = ["evaluate", "--checkpoint", str(tmp_path / "no_checkpoint")]
    assert main([*base, "--out", str(run_folder)]) == 2
    line = one_error_line(capsys)
    assert f"--out {run_folder} holds files `rlm evaluate` did not write (config.yaml, final/)" in line
    assert main([*base, "--save-index", str(run_folder)]) == 2
    assert "--save-index" in one_error_line(capsys)
    assert contents(run_folder) == before
    # Its own predictions and metrics are not in the way (the command goes on, to fail for want of data).
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "predictions.jsonl").write_text("")
    (tmp_path / "eval" / "metrics.json").write_text("{}")
    assert main([*base, "--out", str(tmp_path / "eval")]) == 2
    assert "did not write" not in one_error_line(capsys)


def test_toy_world_refuses_a_folder_of_something_else_and_rebuilds_its_own(tmp_path, run_folder, capsys):
    argv = ["toy-world", "--num-passages", "100", "--max-eval-questions", "5", "--out"]
    before = contents(run_folder)
    assert main([*argv, str(run_folder)]) == 2
    assert "`rlm toy-world` did not write" in one_error_line(capsys)
    assert contents(run_folder) == before
    world = tmp_path / "world"
    assert main([*argv, str(world)]) == 0
    assert main([*argv, str(world), "--seed", "1"]) == 0
    # Questions made from the world later are not its own: a rebuilt world would leave them asking about the old.
    (world / "dev_unanswerable.jsonl").write_text("")
    capsys.readouterr()
    assert main([*argv, str(world)]) == 2
    assert "(dev_unanswerable.jsonl)" in one_error_line(capsys)


def test_embed_refuses_a_folder_of_something_else_and_resumes_its_own_unfinished_build(
    tmp_path, run_folder, capsys
):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": f"p{i}", "title": "T", "text": f"passage number {i}"} for i in range(7)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["embed", "--corpus", str(corpus), "--shard-size", "3", "--max-length", "32", "--no-progress"]
    before = contents(run_folder)
    assert main([*argv, "--out", str(run_folder)]) == 2
    assert "`rlm embed` did not write" in one_error_line(capsys)
    assert contents(run_folder) == before

    buffer_dir = tmp_path / "buffer"
    assert main([*argv, "--out", str(buffer_dir)]) == 0
    complete = PassageBuffer.load(buffer_dir).embeddings.clone()
    # The same folder as a build killed mid-way leaves it: no meta.json or ids.txt, a shard missing and
    # a temporary of it left behind; the rerun resumes it.
    meta = json.loads((buffer_dir / "meta.json").read_text())
    build = {k: v for k, v in meta.items() if k not in ("shards", "ids_file")}
    (buffer_dir / "build.json").write_text(json.dumps(build))
    for name in ("meta.json", "ids.txt", "shard_00001.npy", "shard_00001.json"):
        (buffer_dir / name).unlink()
    (buffer_dir / ".shard_00001.npy.k2x9q0ab.tmp").write_bytes(b"half a shard")
    assert main([*argv, "--out", str(buffer_dir)]) == 0
    assert PassageBuffer.load(buffer_dir).embeddings.equal(complete)
