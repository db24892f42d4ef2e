"""The processes of a launched `rlm evaluate` around the index the main one builds: the others wait for it on disk
(no collective, so no process group's timeout), stop with the main one's error or when it falls silent, and map
the index it saved; `--dist-timeout` bounds every collective. The launched run itself: tests/test_evaluation.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from rlm.cli import main
from rlm.errors import UserError
from rlm.inference.indexing import (
    INDEX_FAILED,
    INDEX_HEARTBEAT,
    INDEX_SUBFOLDER,
    _clear_handoff,
    await_index,
    handing_over_index,
)
from rlm.retriever.index import PassageIndex


def _index(rows: int = 200, dim: int = 8) -> PassageIndex:
    vectors = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    return PassageIndex.build(vectors, [f"p{i}" for i in range(rows)], "IVF4,Flat", use_gpu=False)


def test_a_waiting_process_outlasts_a_long_build_while_the_heartbeat_goes_on_and_maps_the_index(tmp_path):
    """The build takes ten times the silence a waiter tolerates: the heartbeat keeps it waiting, and it gets
    the saved index, memory-mapped."""

    def build() -> None:
        with handing_over_index(tmp_path, every_s=0.05):
            time.sleep(2.0)
            _index().save(tmp_path / INDEX_SUBFOLDER)

    builder = threading.Thread(target=build)
    builder.start()
    try:
        index = await_index(tmp_path, use_gpu=False, silent_after_s=0.2, poll_s=0.02)
    finally:
        builder.join()
    assert index.ntotal == 200 and index.mapped == "IO_FLAG_MMAP"
    assert not (tmp_path / INDEX_HEARTBEAT).exists() and not (tmp_path / INDEX_FAILED).exists()


def test_a_waiting_process_stops_with_the_main_processs_error_when_its_build_fails(tmp_path):
    with pytest.raises(RuntimeError), handing_over_index(tmp_path, every_s=0.05):
        raise RuntimeError(
            "Error in void faiss::Clustering::train_encoded:\n  Number of training points (120)"
        )
    with pytest.raises(UserError) as caught:
        await_index(tmp_path, use_gpu=False, silent_after_s=60, poll_s=0.01)
    message = str(caught.value)
    assert message.startswith("the main process could not build the index: RuntimeError: Error in void")
    assert "\n" not in message and "training points (120)" in message


def test_a_waiting_process_stops_when_the_main_process_falls_silent(tmp_path):
    """No index, no error and no new heartbeat (a main process killed where no launcher ends the others)."""
    (tmp_path / INDEX_HEARTBEAT).write_text("7")
    start = time.monotonic()
    with pytest.raises(UserError, match="no sign of building the index .* for 0 s"):
        await_index(tmp_path, use_gpu=False, silent_after_s=0.3, poll_s=0.02)
    assert time.monotonic() - start < 30


def test_a_waiting_process_never_takes_an_earlier_runs_index_for_this_ones(tmp_path):
    """The main process clears an earlier run's index and error from the embeddings folder before the processes
    meet; only then do the others look for this run's."""
    _index().save(tmp_path / INDEX_SUBFOLDER)
    (tmp_path / INDEX_FAILED).write_text("RuntimeError: an earlier run's")
    met = []
    _clear_handoff(tmp_path, SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: met.append(1)))
    assert met == [1] and sorted(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="no sign of building"):
        await_index(tmp_path, use_gpu=False, silent_after_s=0.1, poll_s=0.02)


@pytest.mark.parametrize("command", ["embed", "evaluate"])
def test_a_dist_timeout_below_ten_seconds_is_refused_in_one_line(tmp_path, capsys, command):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "p0", "title": "t", "text": "a passage"}\n')
    args = ["--corpus", str(corpus), "--out", str(tmp_path / "out"), "--dist-timeout", "5"]
    if command == "evaluate":
        args += ["--retriever", str(tmp_path / "minilm"), "--retrieval-only"]
    assert main([command, *args]) == 2
    assert capsys.readouterr().err.strip() == "error: --dist-timeout is at least 10 seconds, got 5"


def test_rlm_embed_asks_for_a_process_group_that_waits_the_dist_timeout(tmp_path, monkeypatch):
    """Launched (WORLD_SIZE 2), `rlm embed --dist-timeout 30` makes its process group wait 30 s at a collective
    (not PyTorch's default 30 minutes); `rlm evaluate`'s is seen from inside a launch in tests/test_evaluation.py."""
    import datetime

    import accelerate

    asked = {}

    class Launched(Exception):
        pass

    def partial_state(**kwargs):
        asked.update(kwargs)
        raise Launched  # what it asked for is all this test needs

    monkeypatch.setattr(accelerate, "PartialState", partial_state)
    monkeypatch.setenv("WORLD_SIZE", "2")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "p0", "title": "t", "text": "a passage"}\n')
    with pytest.raises(Launched):
        main(["embed", "--corpus", str(corpus), "--out", str(tmp_path / "out"), "--dist-timeout", "30"])
    assert asked["timeout"] == datetime.timedelta(seconds=30)
