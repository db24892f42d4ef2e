# The two commands: `make demo` and `make test`. Everything they need is installed from this file and
# pyproject.toml into .venv, so a fresh clone on a fresh machine needs nothing else.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
# pytest-xdist workers for `make test`: two keep a 2-core machine busy while one waits on a launched process.
TEST_WORKERS ?= 2

# Never reach a model or dataset hub: the offline defaults ship with the packages.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export GRADIO_ANALYTICS_ENABLED := False

.PHONY: demo test test-fast test-kernels lint format bench clean venv browser hooks

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build from this machine's disk (see pyproject.toml).
	$(BIN)/pip install -q torch==2.13.0
	touch $@

$(VENV)/.installed: $(VENV)/.created pyproject.toml
	$(BIN)/pip install -q -e '.[cpu]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install -q -e '.[cpu,test]'
	touch $@

# The lab (scripts/bench) plots and reads memory figures: the `lab` extra.
$(VENV)/.installed-lab: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install -q -e '.[cpu,lab]'
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/rlm quickstart $(DEMO_ARGS)

# Debian's chromium for the real-browser demo test (Playwright drives it via executable_path). Idempotent: does
# nothing when it is installed; where apt-get is missing or not root it says so and the browser test skips
# locally (fails under CI=true) instead of this target failing the whole run.
browser:
	@if [ -x /usr/bin/chromium ]; then \
		true; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; } \
			|| echo "warning: apt-get could not install chromium; the browser test will not run"; \
	else \
		echo "warning: /usr/bin/chromium missing and apt-get (as root) unavailable: apt-get install -y chromium"; \
	fi

# The repository's git hooks (.githooks/commit-msg: subjects of at most 72 characters), for whoever commits
# from this checkout; nothing outside a git checkout.
hooks:
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git config core.hooksPath .githooks; fi

test: $(VENV)/.installed-test browser hooks
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --timeout=900 --durations=15 $(PYTEST_ARGS)

# The learning tests (pytest -m learning) once per float kernel family this CPU can run (default, avx2, avx512:
# ATen, MKL and oneDNN capped together), so a verdict that holds here holds on CPUs with fewer instruction sets.
test-kernels: $(VENV)/.installed-test
	$(PY) scripts/kernel_families.py tests -- -n $(TEST_WORKERS) --dist loadfile --timeout=900 $(PYTEST_ARGS)

test-fast: $(VENV)/.installed-test
	$(BIN)/pytest -q -m "not slow" $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(VENV)/.installed-test
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(VENV)/.installed-lab
	$(PY) scripts/bench/bench_retrieval.py $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache
