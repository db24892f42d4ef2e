#!/usr/bin/env bash
# One GPU session's prepared checks (issue 40), ~10 minutes at most on one GPU: the smoke test of the paper-scale
# paths (scripts/gpu_smoke.sh), then the paper-shape step benchmark (scripts/bench_paper_step.py: T5-base
# reader, GTR-base towers, 4 x 32 x 256 per micro-step, 2.63M buffer rows). Each runs under its own time limit and
# writes its report as it goes, so a session cut short keeps what ran.
#   bash scripts/gpu_bench.sh                                   # reports under runs/gpu_bench/
#   GPU_BENCH_OUT=$OUT bash scripts/gpu_bench.sh --retriever tiny  # options go to gpu_smoke.sh; $OUT: the folder
#                                                               # the device tool brings back (6 files)
#   BENCH_ARGS="--strategies corrector_h8192,exhaustive" bash scripts/gpu_bench.sh   # options for the benchmark
# Exit 0 when both passed, 1 otherwise (the reports say what failed). Never reaches a hub; record each run in
# docs/results/gpu_smoke/gpu_smoke.md and docs/results/bench_paper_step/bench_paper_step.md with its device.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${GPU_BENCH_OUT:-runs/gpu_bench}"
mkdir -p "$out"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
# The smoke test took 60-90 s on an H200 (docs/results/gpu_smoke/gpu_smoke.md).
timeout 200 bash scripts/gpu_smoke.sh --out "$out/gpu_smoke" "$@"
smoke=$?
# Five strategies of ~60 s at most each (the script stops one at its limit and goes on), the buffer and the
# imports first; `timeout` is the backstop for a native call that never returns to Python.
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout 360 "$PY" scripts/bench_paper_step.py --timeout-per-strategy 60 --out "$out/bench_paper_step" ${BENCH_ARGS:-}
bench=$?
echo "gpu_smoke: exit $smoke; bench_paper_step: exit $bench; reports in $out"
[ "$smoke" = 0 ] && [ "$bench" = 0 ]
