# The README's two commands: `make run` (the whole pipeline on the embedded default) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements/lock.txt pyproject.toml | cksum | cut -d' ' -f1)
# The test tools (requirements/lock-dev.txt) on top: `make test` only, so `make run` installs the runtime set.
DEV_STAMP := $(VENV)/.installed-dev-$(shell cat requirements/lock.txt requirements/lock-dev.txt pyproject.toml | cksum | cut -d' ' -f1)

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export GX_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
# MLflow reads only "true" (not DO_NOT_TRACK=1); its telemetry thread sets and unsets an environment variable that
# a concurrent client request reads, a race seen as KeyError '_MLFLOW_TELEMETRY_SESSION_ID' in the tests.
export MLFLOW_DISABLE_TELEMETRY ?= true

.PHONY: install install-dev run test test-fast lint docs bench clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): requirements/lock.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or run make PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade -q "pip>=24"
	$(BIN)/python -m pip install -r requirements/lock.txt
	$(BIN)/python -m pip install --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*; touch $@

$(DEV_STAMP): $(STAMP) requirements/lock-dev.txt
	$(BIN)/python -m pip install -r requirements/lock-dev.txt
	rm -f $(VENV)/.installed-dev-*; touch $@

# dvc runs each stage's `xbn` command, so the venv's bin goes first on PATH. Each stage prints a line or two;
# `dvc repro -q` keeps DVC's own chatter (git hints) out, so on a failure of DVC itself, rerun without -q.
run: install
	@PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro -q || { echo "make run: dvc repro failed (run \
	'$(BIN)/dvc repro' to see DVC's own message)" >&2; exit 1; }
	@$(BIN)/xbn summary

# ruff and mypy (its files and settings: pyproject's [tool.mypy]) over the package and the flows' entrypoints
# (CI runs it before the tests: .ci/run). A cold mypy run takes about 25 s on 2 cores (pyproject's num_workers;
# 43 s in one process), a warm one 2 s.
lint: install-dev
	$(BIN)/ruff check src pipelines
	$(BIN)/mypy

# The docs site (mkdocs.yml) into site/, strict: a broken link or anchor, a page left out of the nav or an API
# reference that no longer resolves fails it (CI runs it). `$(BIN)/mkdocs serve` to read it while writing.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Every tier (tests/conftest.py's TIERS), grouped by module: a module that starts servers runs on one worker.
# Three workers on two cores: a third fills the time the other two spend waiting on servers and subprocesses
# (measured on the 2-core EPYC: 14:00 with two, 13:29 with three; the cores idle 13% of the run with two, 0.4%
# with three). TEST_WORKERS=N for another machine.
TEST_WORKERS ?= 3
test: install-dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=20 tests

# The unit tier alone (a few minutes on 2 cores); a unit test over 5 s fails, naming itself.
test-fast: install-dev
	XBN_UNIT_LIMIT_S=5 $(BIN)/python -m pytest -n 2 --dist loadfile --durations=10 -m unit tests

# `make bench BENCH_ARGS="--quick --allow-dirty"`: the smoke variants, from a tree with uncommitted changes.
bench: install-dev
	$(BIN)/python -m benchmarks all $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache site
