#!/usr/bin/env bash
# One GPU session's prepared checks (issues 40 and 48) on a node with torch, transformers and accelerate and
# no network, 9 minutes at most on one GPU: the wheels of a bundle installed (`--bundle DIR`: deepspeed,
# faiss-cpu and their needs, built beforehand on a connected machine by `python scripts/gpu_bundle.py DIR`),
# the smoke test of the paper-scale paths (scripts/bench/gpu_smoke.sh), then the paper-shape step benchmark
# (scripts/bench/bench_paper_step.py: T5-base reader, GTR-base towers, 4 x 32 x 256 per micro-step, 2.63M rows).
# Each step has a time limit: install 60 s + smoke 180 s + benchmark 290 s = 530 s. Reports are written as they
# go: the smoke's after each of its stages (the first once the install and the imports are done, within 2
# minutes), the benchmark's after each strategy, and a line in gpu_bench.log as each step ends; a session cut
# short keeps what ran.
#   bash scripts/gpu_bench.sh --bundle DIR                      # reports under runs/gpu_bench/
#   GPU_BENCH_OUT=$OUT bash scripts/gpu_bench.sh --bundle DIR --retriever tiny  # other options go to
#                                                  # gpu_smoke.sh; $OUT: the folder the device tool brings back
#                                                  # (7 files: nvidia-smi.txt, gpu_bench.log, 2 + 3 reports)
#   BENCH_ARGS="--strategies corrector_h8192,exhaustive" bash scripts/gpu_bench.sh   # options for the benchmark
# The wheels go to a temporary folder (pip --target, put on PYTHONPATH), never into the node's environment.
# Exit 0 when both passed, 1 otherwise (the reports say what failed). Never reaches a hub or an index; record
# each run in scripts/bench/reports/gpu_smoke/gpu_smoke.md and scripts/bench/reports/bench_paper_step/bench_paper_step.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
bundle=""
smoke_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle="${2:?--bundle needs a folder}"; shift 2 ;;
    --bundle=*) bundle="${1#--bundle=}"; shift ;;
    *) smoke_args+=("$1"); shift ;;
  esac
done
out="${GPU_BENCH_OUT:-runs/gpu_bench}"
mkdir -p "$out"
log="$out/gpu_bench.log"
: >"$log"
note() { echo "gpu_bench: $*" | tee -a "$log"; }
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true

if [ -n "$bundle" ]; then
  SECONDS=0
  site="$(mktemp -d "${TMPDIR:-/tmp}/gpu_bench_site.XXXXXX")"
  trap 'rm -rf "$site"' EXIT
  # A bundle copied by hand may be cut short: install nothing from one whose files are not what it lists.
  if ! (cd "$bundle" && sha256sum --quiet -c SHA256SUMS) >>"$log" 2>&1; then
    note "install: refused, the files of $bundle do not match its SHA256SUMS (nothing installed)"
  # --no-deps: the bundle names every package the node lacks (scripts/gpu_bundle.py), and a --target install
  # would otherwise look for torch in the bundle too.
  elif timeout 60 "$PY" -m pip install --quiet --no-index --find-links "$bundle/wheels" --no-deps \
    --no-compile --target "$site" "$bundle"/wheels/*.whl >>"$log" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$site"
    # What Python finds there through that PYTHONPATH, as every step below will.
    installed="$(SITE="$site" "$PY" -c 'import importlib.metadata as m, os
here = [d for d in m.distributions() if str(d.locate_file("")) == os.environ["SITE"]]
print(" ".join(sorted(f"{d.name}-{d.version}" for d in here)))')"
    note "install: ${installed} in ${SECONDS} s (pip install --no-index --find-links $bundle/wheels)"
  else
    note "install: failed (exit $?; pip's message above), the stages that need the bundle SKIP"
  fi
fi

# The smoke test took 60-90 s on an H200 (scripts/bench/reports/gpu_smoke/gpu_smoke.md); --budget leaves its last
# report to the script, `timeout` is the backstop for a native call that never returns to Python.
SECONDS=0
timeout 180 bash scripts/bench/gpu_smoke.sh --out "$out/gpu_smoke" --budget 150 ${smoke_args[@]+"${smoke_args[@]}"}
smoke=$?
note "gpu_smoke: exit $smoke in ${SECONDS} s, report in $out/gpu_smoke/gpu_smoke.md"
# Five strategies of ~50 s at most each (the script stops one at its limit and goes on), the buffer and the
# imports first.
SECONDS=0
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout 290 "$PY" scripts/bench/bench_paper_step.py --timeout-per-strategy 50 --out "$out/bench_paper_step" \
  ${BENCH_ARGS:-}
bench=$?
note "bench_paper_step: exit $bench in ${SECONDS} s, report in $out/bench_paper_step.md"
[ "$smoke" = 0 ] && [ "$bench" = 0 ]
