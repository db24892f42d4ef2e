"""The repository's commit-msg hook (`.githooks/commit-msg`, which `make test` points git at): a subject of at
most 72 characters, then a blank line before the body."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HOOKS = Path(__file__).resolve().parents[1] / ".githooks"


def hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run(["bash", str(HOOKS / "commit-msg"), str(path)], capture_output=True, text=True)


def test_a_subject_of_72_characters_passes_and_73_is_refused_saying_where_the_detail_goes(tmp_path):
    assert hook(tmp_path, "x" * 72 + "\n\nThe figures, in the body.\n").returncode == 0
    refused = hook(tmp_path, "x" * 73 + "\n")
    assert refused.returncode == 1 and "73 characters, at most 72" in refused.stderr
    assert "body" in refused.stderr


def test_gits_comment_lines_are_not_the_message_and_the_body_needs_a_blank_line_before_it(tmp_path):
    assert (
        hook(tmp_path, "# Please enter the commit message\nShort subject\n\nBody.\n# more\n").returncode == 0
    )
    run_on = hook(tmp_path, "Short subject\nbody right under it\n")
    assert run_on.returncode == 1 and "blank line" in run_on.stderr
    assert hook(tmp_path, "# only comments\n").returncode == 0  # git aborts an empty message itself


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_commit_refuses_a_long_subject_through_the_hooks_path(tmp_path):
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True)

    git("init", "-q")
    git("config", "core.hooksPath", str(HOOKS))
    (tmp_path / "a.txt").write_text("a")
    git("add", "a.txt")
    who = ["-c", "user.name=t", "-c", "user.email=t@example.org"]
    refused = git(*who, "commit", "-q", "-m", "y" * 80)
    assert refused.returncode != 0 and "at most 72" in refused.stderr
    assert git(*who, "commit", "-q", "-m", "Add a.txt").returncode == 0
