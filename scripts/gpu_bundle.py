"""Build, on a machine with network, the folder an air-gapped GPU node needs for `bash scripts/gpu_bench.sh
--bundle DIR`: what a node with torch, transformers and accelerate lacks for the smoke test and the benchmark,
and the repository itself, at most 64 MiB (what the device tool carries beside the working tree).

    python scripts/gpu_bundle.py OUT              # build OUT (it must not exist, or be empty)
    python scripts/gpu_bundle.py OUT --dry-run    # print what it would fetch and run; fetch nothing

OUT holds:
  wheels/        for the node's Python and platform (default CPython 3.12 on manylinux x86_64, the H200
                 machines'), fetched by `pip download --no-deps --only-binary=:all:`; every dependency is named
                 in WHEELS, so that torch (~900 MB) and what the node already has are never pulled in.
                 faiss-cpu: `rlm evaluate` and `QAService` search a faiss index. faiss-gpu does not fit:
                 faiss-gpu-cu12 is a 48 MB wheel that needs CUDA 12's cuBLAS and runtime wheels, and the H200
                 image runs CUDA 13.
                 deepspeed: PyPI has only its source tarball, whose setup.py compiles its C++/CUDA ops only
                 when it can import torch. `pip wheel --no-deps` builds it here in an isolated environment
                 without torch (and DS_BUILD_OPS=0), so the ops are left to be compiled on first use on the
                 node (nvcc, ninja) and the wheel is pure Python (py3-none-any): it installs on any node
                 without a compiler or an index. A build that gives anything else is refused.
  repo.tar.gz    `git archive` of a commit (`--ref`, default HEAD) under `rlm-corrector/`: uncommitted
                 changes are not in it (a warning counts them).
  manifest.json  each file's size and sha256, the total and the limit; SHA256SUMS, for `sha256sum -c`.

Versions: those installed in the Python running this script, where it has them (the versions its tests ran
with), else the index's newest. The folder is built beside OUT and renamed into place only when it is under
`--max-mb`; over it, nothing is left and the exit status is 1. On the node:

    mkdir rlm && tar xzf OUT/repo.tar.gz -C rlm --strip-components 1 && cd rlm
    bash scripts/gpu_bench.sh --bundle OUT
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
MAX_MB = 64  # MiB: the device tool carries 64 MiB with the working tree (/work/.library/device/README.md)
# What the smoke test and the benchmark import beyond torch, transformers and accelerate (and their own
# dependencies: numpy, packaging, psutil, tqdm, pyyaml, safetensors, tokenizers), each dependency named.
WHEELS = [
    "faiss-cpu",
    # deepspeed's dependencies (its METADATA's Requires-Dist) beyond those
    "einops",
    "hjson",
    "msgpack",
    "ninja",
    "py-cpuinfo",
    "pydantic",
    # pydantic's
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
]
FROM_SOURCE = "deepspeed"  # only an sdist on PyPI: built into a pure-Python wheel here
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


class Refused(Exception):
    """The bundle cannot be built as asked; the message says why."""


def pinned(distribution: str) -> str:
    """`name==version` of the version installed here, else `name` (the index's newest)."""
    try:
        return f"{distribution}=={importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return distribution


def download_command(pip: list[str], args: argparse.Namespace, dest: Path) -> list[str]:
    abi = "cp" + args.python_version.replace(".", "")
    cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", args.python_version]
    cmd += ["--implementation", "cp", "--abi", abi]
    cmd += [arg for platform in args.platform for arg in ("--platform", platform)]
    return [*cmd, "-d", str(dest), *(pinned(name) for name in WHEELS)]


def wheel_command(pip: list[str], dest: Path) -> list[str]:
    return [*pip, "wheel", "--no-deps", "-w", str(dest), pinned(FROM_SOURCE)]


def archive_command(ref: str, dest: Path) -> list[str]:
    return [
        "git",
        "-C",
        str(ROOT),
        "archive",
        "--format=tar.gz",
        "--prefix=rlm-corrector/",
        "-o",
        str(dest),
        ref,
    ]


def folder_bytes(folder: Path) -> dict[str, int]:
    """Every file under `folder` by its path relative to it, with its size."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in files}


def check_size(folder: Path, limit: int, after: str) -> None:
    sizes = folder_bytes(folder)
    total = sum(sizes.values())
    if total > limit:
        largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
        listed = ", ".join(f"{name} {size / MIB:.1f} MiB" for name, size in largest)
        raise Refused(
            f"refused: {total / MIB:.1f} MiB after {after}, over the limit of {limit / MIB:g} MiB "
            f"(largest: {listed}); nothing was kept"
        )


def run(cmd: list[str], **kwargs) -> None:
    print("+ " + shlex.join(cmd), flush=True)
    done = subprocess.run(cmd, **kwargs)
    if done.returncode != 0:
        raise Refused(f"{shlex.join(cmd[:3])} ... exited {done.returncode}")


def uncommitted() -> int:
    """Changed and untracked (not ignored) files of the checkout, which `git archive` leaves out."""
    done = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    return len(done.stdout.splitlines()) if done.returncode == 0 else 0


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, args: argparse.Namespace, limit: int) -> dict:
    sizes = folder_bytes(folder)
    files = [{"path": name, "bytes": size, "sha256": sha256(folder / name)} for name, size in sizes.items()]
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", args.ref], capture_output=True, text=True, check=True
    ).stdout.strip()
    manifest = {
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "ref": args.ref,
        "commit": commit,
        "python_version": args.python_version,
        "platforms": args.platform,
        "files": files,
        "total_bytes": sum(sizes.values()),
        "limit_bytes": limit,
        "install": "bash scripts/gpu_bench.sh --bundle DIR",
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (folder / "SHA256SUMS").write_text("".join(f"{f['sha256']}  {f['path']}\n" for f in files))
    return manifest


def build(out: Path, args: argparse.Namespace, pip: list[str]) -> dict:
    """Build the bundle in a folder beside `out` and rename it into place when it is under the limit."""
    limit = int(args.max_mb * MIB)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "wheels").mkdir(parents=True)
    try:
        run(download_command(pip, args, partial / "wheels"))
        check_size(partial, limit, "the wheels")
        built = partial / "built"
        # DS_BUILD_OPS=0: no op compiled here even where this machine's build could import torch.
        run(wheel_command(pip, built), env={**os.environ, "DS_BUILD_OPS": "0"})
        wheels = sorted(built.glob("*.whl"))
        if len(wheels) != 1 or not wheels[0].name.endswith("-py3-none-any.whl"):
            names = [w.name for w in wheels]
            raise Refused(f"refused: the {FROM_SOURCE} build gave {names}, not one pure-Python wheel")
        wheels[0].rename(partial / "wheels" / wheels[0].name)
        built.rmdir()
        check_size(partial, limit, f"the {FROM_SOURCE} wheel")
        run(archive_command(args.ref, partial / "repo.tar.gz"))
        manifest = write_manifest(partial, args, limit)
        check_size(partial, limit, "the repository and the manifest")
        if out.exists():
            out.rmdir()  # empty: checked before the build
        partial.rename(out)
        return manifest
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="the folder to build (absent or empty)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be fetched and run, and stop"
    )
    parser.add_argument("--ref", default="HEAD", help="the commit `git archive` packs (default HEAD)")
    parser.add_argument("--python-version", default="3.12", help="the node's Python (default 3.12)")
    parser.add_argument("--platform", action="append", help=f"wheel platform tags (default {PLATFORMS})")
    parser.add_argument("--max-mb", type=float, default=MAX_MB, help=f"size limit, MiB (default {MAX_MB})")
    parser.add_argument("--pip", default=f"{shlex.quote(sys.executable)} -m pip", help="the pip command")
    args = parser.parse_args(argv)
    args.platform = args.platform or PLATFORMS
    out, pip = args.out.resolve(), shlex.split(args.pip)
    if args.dry_run:
        print(f"would build {out} (at most {args.max_mb:g} MiB) with:")
        print(shlex.join(download_command(pip, args, out / "wheels")))
        print("DS_BUILD_OPS=0 " + shlex.join(wheel_command(pip, out / "wheels")))
        print(shlex.join(archive_command(args.ref, out / "repo.tar.gz")))
        return 0
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        parser.error(f"{out} exists and is not an empty folder")
    if changed := uncommitted():
        print(f"warning: {changed} uncommitted change(s) are not in repo.tar.gz, which holds {args.ref}")
    try:
        manifest = build(out, args, pip)
    except Refused as why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    for f in manifest["files"]:
        print(f"{f['bytes'] / MIB:8.2f} MiB  {f['path']}")
    total, limit = manifest["total_bytes"] / MIB, manifest["limit_bytes"] / MIB
    print(
        f"{total:8.2f} MiB  in all, of at most {limit:g}; on the node: "
        f"bash scripts/gpu_bench.sh --bundle {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
