#!/usr/bin/env bash
# Smoke test of the paper-scale paths on a CUDA machine (a few minutes on one GPU): one PASS/FAIL/SKIP line
# per stage, runs/gpu_smoke/report/gpu_smoke.{json,md}, exit 1 when a stage fails (scripts/bench/reports/gpu_smoke/gpu_smoke.md).
#   bash scripts/bench/gpu_smoke.sh                  # GPU
#   bash scripts/bench/gpu_smoke.sh --device cpu     # the same stages on CPU (the GPU-only ones SKIP)
# Uses .venv when present (make venv), else the python on PATH; never reaches a hub (tiny models, toy world).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/bench/gpu_smoke.py "$@"
