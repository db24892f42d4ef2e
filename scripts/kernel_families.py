"""The same verdict on every CPU kind: the learning tests, or the quickstart's table, under each float kernel family.

A model trained from scratch lands elsewhere on each family of float kernels (ATen's default / avx2 / avx512,
with MKL's and oneDNN's code paths capped to match: `scripts/bench/lab/kernel_families.py`). This runs, on one
machine, what every CPU kind it can stand in for computes:

    # the learning tests (pytest -m learning) under each family this CPU runs; `make test-kernels`
    python scripts/kernel_families.py tests
    # the quickstart's table for seeds 0, 1 and 2 under each family, with its verdict per run
    python scripts/kernel_families.py quickstart --seeds 0,1,2 --runs-dir runs/kernel_families \
        --out scripts/bench/reports/quickstart/kernel_families

`tests` prints one line per family and exits 1 when a family fails. `quickstart` trains the corrector run and its
baselines once per (family, seed) (`rlm quickstart --no-serve`, about 8 minutes each on 2 cores), keeps each
run's folder under `--runs-dir` (a finished one is read, not retrained: the command resumes where it stopped),
and writes `<out>.json` and `<out>.md`: every run's dev EM from its own selection and re-embedded, the verdict
(corrector within 3 points of exhaustive, at least 10 above frozen, not below stale, in both columns) and the
mean and spread over seeds per family and over everything.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent / "bench")
)  # the lab's shared code, as benchmarks see it
from lab.kernel_families import FAMILIES, TORCH_CAPABILITY, family_environment, parse_families
from lab.reporting import (
    ROOT,
    arguments,
    child_env,
    cpu_name,
    int_list,
    results_path,
    table,
    write_report,
)

RUNS = ("corrector", "exhaustive", "stale", "frozen", "closed_book")
# The verdict: the corrector against each baseline, in points of dev EM, in both columns.
WITHIN_EXHAUSTIVE, ABOVE_FROZEN = 3.0, 10.0


def torch_capability(env: dict) -> str:
    """What torch reports under `env`: the proof that the family's cap took."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def run_tests(families: list[str], pytest_args: list[str]) -> int:
    rows = []
    for family in families:
        env = child_env(**family_environment(family))
        capability = torch_capability(env)
        if capability != TORCH_CAPABILITY[family]:
            raise SystemExit(
                f"error: torch runs {capability} under the {family} caps, not {TORCH_CAPABILITY[family]}"
            )
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "learning", "-p", "no:cacheprovider", *pytest_args]
        print(
            f"== {family}: {' '.join(f'{k}={v}' for k, v in FAMILIES[family].items())} {' '.join(cmd[1:])}",
            flush=True,
        )
        start = time.perf_counter()
        code = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        rows.append(
            {"family": family, "torch": capability, "exit": code, "seconds": time.perf_counter() - start}
        )
    print(f"\nlearning tests under each kernel family ({cpu_name()}):")
    print(
        table(
            rows,
            [
                ("family", "family", ""),
                ("torch capability", "torch", ""),
                ("pytest exit", "exit", "d"),
                ("seconds", "seconds", ".0f"),
            ],
        )
    )
    return 0 if all(r["exit"] == 0 for r in rows) else 1


def quickstart_run(family: str, seed: int, runs_dir: Path, extra: list[str]) -> dict:
    """Train (or read back) the quickstart of one (family, seed); its table as points of dev EM."""
    out = runs_dir / f"{family}-seed{seed}"
    metrics_file = out / "metrics.json"
    if not metrics_file.is_file():
        cmd = [
            sys.executable,
            "-m",
            "rlm",
            "quickstart",
            "--no-serve",
            "--no-edition",  # the table is what this compares; the living corpus stage would add its time
            "--baselines",
            "--output-dir",
            str(out),
        ]
        cmd += ["--set", f"seed={seed}", *extra]
        print(f"== {family} seed {seed}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, env=child_env(**family_environment(family)), cwd=ROOT, check=True)
    metrics = json.loads(metrics_file.read_text())
    row = {"family": family, "seed": seed, "run_dir": str(out), "settings": metrics.get("settings")}
    dev = metrics["dev"]
    row["corrector"] = {"own": 100 * dev["selection_exact_match"], "reembedded": 100 * dev["exact_match"]}
    for name, base in metrics["baselines"].items():
        own = base.get("selection_exact_match")
        row[name] = {
            "own": 100 * (own if own is not None else base["exact_match"]),
            "reembedded": 100 * base["exact_match"],
        }
    row["verdict"] = verdict(row)
    return row


def verdict(row: dict) -> dict:
    """The corrector against each baseline in both columns: within 3 of exhaustive, >= 10 above frozen, not
    below stale."""
    checks = {}
    for column in ("own", "reembedded"):
        c = row["corrector"][column]
        checks[f"within {WITHIN_EXHAUSTIVE:g} of exhaustive ({column})"] = (
            c >= row["exhaustive"][column] - WITHIN_EXHAUSTIVE
        )
        checks[f">= {ABOVE_FROZEN:g} above frozen ({column})"] = c >= row["frozen"][column] + ABOVE_FROZEN
        checks[f"not below stale ({column})"] = c >= row["stale"][column]
    return {"holds": all(checks.values()), "checks": checks}


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.1f} ({max(values) - min(values):.1f})"


def render(results: dict) -> str:
    rows = results["runs"]
    lines = [
        "# The quickstart's table under each float kernel family",
        "",
        f"CPU: {results['cpu']}; flags `{results['flags']}`; {results['date']}. Each family runs with ATen, MKL and "
        "oneDNN capped together (`scripts/bench/lab/kernel_families.py`); one row per (family, seed), world seed 0, "
        f"dev EM in points (one question = {100 / results['dev_questions']:.2f}). Command: `{results['command']}`.",
        "",
    ]
    columns = [("family", "family", ""), ("seed", "seed", "d")]
    for name in RUNS:
        columns.append(
            (
                f"{name} own / re-embedded",
                lambda r, n=name: f"{r[n]['own']:.1f} / {r[n]['reembedded']:.1f}",
                "",
            )
        )
    columns.append(
        (
            "corrector - exhaustive (own / re-emb.)",
            lambda r: "{:+.1f} / {:+.1f}".format(
                *(r["corrector"][c] - r["exhaustive"][c] for c in ("own", "reembedded"))
            ),
            "",
        )
    )
    columns.append(
        (
            "verdict",
            lambda r: (
                "holds"
                if r["verdict"]["holds"]
                else "FAILS: " + "; ".join(k for k, v in r["verdict"]["checks"].items() if not v)
            ),
            "",
        )
    )
    lines += [
        table(rows, columns),
        "",
        "Mean (spread = max - min) over seeds, per family and over every run:",
        "",
    ]
    summary = []
    for family in [*dict.fromkeys(r["family"] for r in rows), "all"]:
        part = [r for r in rows if family in ("all", r["family"])]
        entry = {"family": family, "runs": len(part)}
        for name in RUNS:
            entry[name] = " / ".join(spread([r[name][c] for r in part]) for c in ("own", "reembedded"))
        summary.append(entry)
    summary_columns = [("family", "family", ""), ("runs", "runs", "d")]
    summary_columns += [(f"{name} own / re-embedded", name, "") for name in RUNS]
    lines += [table(summary, summary_columns), ""]
    held = sum(r["verdict"]["holds"] for r in rows)
    lines += [f"The verdict holds on {held} of {len(rows)} runs.", "", by_run(rows)]
    return "\n".join(lines)


def by_run(rows: list[dict]) -> str:
    """One line per run (the README's table): each family's mean over seeds, then every run's mean and spread."""
    families = list(dict.fromkeys(r["family"] for r in rows))
    out = []
    for name in RUNS:
        entry = {"run": name}
        for column in ("own", "reembedded"):
            means = [statistics.fmean(r[name][column] for r in rows if r["family"] == f) for f in families]
            entry[column] = " / ".join(f"{m:.1f}" for m in means)
            entry[f"{column}_all"] = spread([r[name][column] for r in rows])
        out.append(entry)
    each = " / ".join(families)
    columns = [("run", "run", ""), (f"EM own selection, {each}", "own", ""), ("mean (spread)", "own_all", "")]
    columns += [(f"EM re-embedded, {each}", "reembedded", ""), ("mean (spread)", "reembedded_all", "")]
    seeds = len({r["seed"] for r in rows})
    return (
        f"Per run: the mean over {seeds} seeds under each family, then over all {len(rows)} runs:\n\n"
        + table(out, columns)
    )


def run_quickstarts(
    families: list[str], seeds: list[int], runs_dir: Path, out: Path, extra: list[str]
) -> int:
    from rlm.precision import read_cpu_flags

    flags = sorted(f for f in (read_cpu_flags() or ()) if f.startswith(("avx", "amx", "fma", "sse4")))
    rows = [quickstart_run(family, seed, runs_dir, extra) for family in families for seed in seeds]
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_name(),
        "flags": " ".join(flags),
        "command": " ".join(["python", "scripts/kernel_families.py", *sys.argv[1:]]),
        "dev_questions": json.loads((Path(rows[0]["run_dir"]) / "metrics.json").read_text())["dev_questions"],
        "runs": rows,
    }
    write_report(out, render(results), results)
    return 0 if all(r["verdict"]["holds"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    tests = sub.add_parser("tests", help="pytest -m learning under each family")
    tests.add_argument("--families", default="all", help="'all' (those this CPU runs) or e.g. default,avx2")
    tests.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    quick = sub.add_parser("quickstart", help="the quickstart's table under each family and seed")
    quick.add_argument("--families", default="all", help="'all' (those this CPU runs) or e.g. default,avx2")
    quick.add_argument("--seeds", type=int_list, default=[0, 1, 2])
    quick.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "kernel_families")
    quick.add_argument("--out", type=Path, default=results_path("kernel_families"))
    quick.add_argument(
        "--set", dest="overrides", action="append", default=[], help="a config key=value for every run"
    )
    args = parser.parse_args(argv)
    families = parse_families(args.families)
    if args.what == "tests":
        return run_tests(families, args.pytest_args)
    extra = [x for kv in args.overrides for x in ("--set", kv)]
    return run_quickstarts(families, args.seeds, args.runs_dir, args.out, extra)


if __name__ == "__main__":
    sys.exit(main())
