"""atomicio: a failed write leaves the old file or folder in place and no temporary behind; and it is the one
implementation (no package or script writes its own temp-file-and-rename)."""

import json
import os
import re
import stat
from pathlib import Path

import pytest

from rlm.base.atomicio import (
    atomic_directory,
    atomic_file,
    atomic_open,
    atomic_save_torch,
    atomic_write_json,
    atomic_write_text,
    foreign_entries,
)

ROOT = Path(__file__).resolve().parents[1]


class Crash(Exception):
    pass


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.txt"
    atomic_write_text(path, "old\n")
    with pytest.raises(Crash), atomic_open(path) as fh:
        fh.write("half of the new conte")
        raise Crash
    assert path.read_text() == "old\n"
    with pytest.raises(Crash), atomic_file(path) as tmp:
        tmp.write_text("new")
        raise Crash
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.txt"]
    with atomic_open(path, "wb") as fh:
        fh.write(b"new\n")
    assert path.read_text() == "new\n"
    with pytest.raises(ValueError, match="mode must start with 'w'"), atomic_open(path, "a"):
        pass


def test_json_and_torch_round_trip(tmp_path):
    import torch

    atomic_write_json(tmp_path / "a.json", {"b": 1, "a": [1, 2]}, sort_keys=True)
    text = (tmp_path / "a.json").read_text()
    assert text.endswith("}\n") and text.index('"a"') < text.index('"b"')
    assert json.loads(text) == {"a": [1, 2], "b": 1}
    atomic_save_torch({"w": torch.arange(3)}, tmp_path / "w.pt")
    assert torch.equal(torch.load(tmp_path / "w.pt")["w"], torch.arange(3))


def test_a_directory_is_replaced_whole_or_not_at_all(tmp_path):
    final = tmp_path / "model"
    with atomic_directory(final) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(Crash), atomic_directory(final) as tmp:
        (tmp / "weights").write_text("v2, half written")
        raise Crash
    assert (final / "weights").read_text() == "v1"
    with atomic_directory(final) as tmp:
        (tmp / "weights").write_text("v2")
    assert (final / "weights").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    with pytest.raises(FileExistsError, match="already exists"), atomic_directory(final, overwrite=False):
        pass


def test_foreign_entries_are_what_the_writer_does_not_own_its_leftover_temporaries_aside(tmp_path):
    own = ("meta.json", "shard_*.npy")
    assert foreign_entries(tmp_path / "missing", own) == []
    for name in ("meta.json", "shard_00000.npy", ".shard_00001.npy.k2x9q0ab.tmp", "notes.txt", ".x.y.tmp"):
        (tmp_path / name).write_text("")
    (tmp_path / "final").mkdir()
    assert foreign_entries(tmp_path, own) == [".x.y.tmp", "final", "notes.txt"]


# The helpers themselves, and renames that are not a temp-file write: a checkpoint folder that every process
# writes into before the main process renames it (rlm/training/checkpointing.py).
ALLOWED = {"rlm/base/atomicio.py": 4, "rlm/training/checkpointing.py": 2}


def test_no_module_or_script_writes_its_own_temp_file_and_rename():
    found = {}
    for folder in ("rlm", "reader", "retriever", "app", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            count = len(re.findall(r"os\.replace\(|\.replace\(tmp|tempfile\.mkstemp\(", text))
            if count:
                found[str(path.relative_to(ROOT))] = count
    assert found == ALLOWED, "use atomicio's helpers instead of a hand-written temp file + rename"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_results_get_the_mode_a_plain_write_would_give_them(tmp_path, umask):
    """Temporary files and folders are private (0600 / 0700); what lands at the destination must not be, or a
    checkpoint, a buffer or metrics.json written for a team would be readable by its writer alone."""
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "metrics.json", "{}")
        with atomic_directory(tmp_path / "final") as folder:
            (folder / "weights.bin").write_bytes(b"0")
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        (tmp_path / "plain_dir").mkdir()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "metrics.json").stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert stat.S_IMODE((tmp_path / "metrics.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "final").stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((tmp_path / "final").stat().st_mode) == stat.S_IMODE(
        (tmp_path / "plain_dir").stat().st_mode
    )
