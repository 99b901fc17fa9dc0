# The two commands of the README:
#   make run   - set up .venv and analyze the embedded example model in data/
#   make test  - set up .venv and run the test suite
# Tool versions (ruff, mypy) and the docs' dependencies are pinned in setup.cfg's extras only.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The JAX job's virtualenv: Keras on JAX, no TensorFlow.
JAX_VENV ?= .venv-jax
JAX_BIN := $(JAX_VENV)/bin
OUT ?= out
LINTED := spectra tests benchmarks data notebooks docs .ci
.PHONY: help venv install run test test-all test-suite test-jax test-fast warm-test-cache lint ruff-check format-check typecheck docs bench bench-quick mutate clean

help:
	@echo "make run       analyze the example checkpoint in data/ (writes $(OUT)/)"
	@echo "make test      make lint, then the test suite, then make test-jax"
	@echo "make test-all  make test with the tests marked long (the localhost cluster, ...)"
	@echo "make test-jax  the JAX backend's tests and make run's analysis, without TensorFlow"
	@echo "make lint      ruff check, ruff format --check and mypy (make typecheck)"
	@echo "make docs      build the documentation site into $(OUT)/site (warnings are errors)"
	@echo "make bench     run the benchmarks (ratios to a compiled gradient)"
	@echo "make bench-quick  the reduced scale benchmark (ResNet-20, small GPT; about 10 min)"
	@echo "make mutate    mutation testing of the numerical core (long; report in $(OUT)/mutation/)"

# Packages go in with uv (pip installs it into each virtualenv first): it downloads in
# parallel and unpacks faster, about 30 s for the development virtualenv against about 70 s
# with pip. --compile-bytecode writes the .pyc files at install, as pip does: where
# PYTHONDONTWRITEBYTECODE is set (this project's machines), every process would otherwise
# compile each module it imports from source (the suite took 562 s without, 554 s with).
# The bench extra goes in with pip, which reads pip's configuration (a machine's local
# wheels of PyTorch, for instance); uv does not.
UV_VERSION = 0.13.9
UV_INSTALL = -m uv pip install --quiet --compile-bytecode --python
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv==$(UV_VERSION)

# Re-install when the package metadata changes. One stamp per set of extras:
# the package alone (make run), development (tests, lint tools, docs), mutation testing.
$(VENV)/.installed-run: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python $(UV_INSTALL) $(BIN)/python -e .
	touch $@

$(VENV)/.installed-dev: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python $(UV_INSTALL) $(BIN)/python -e ".[test,lint,docs]"
	touch $@

# spectra without its dependencies, then install_requires less TensorFlow and the test-jax
# extra (.ci/requirements_without_tensorflow.py reads setup.cfg): TensorFlow never installed.
$(JAX_VENV)/.installed-jax: setup.cfg pyproject.toml .ci/requirements_without_tensorflow.py
	$(PYTHON) -m venv $(JAX_VENV)
	$(JAX_BIN)/python -m pip install --quiet uv==$(UV_VERSION)
	$(PYTHON) .ci/requirements_without_tensorflow.py test-jax > $(JAX_VENV)/requirements.txt
	$(JAX_BIN)/python $(UV_INSTALL) $(JAX_BIN)/python -r $(JAX_VENV)/requirements.txt
	$(JAX_BIN)/python $(UV_INSTALL) $(JAX_BIN)/python --no-deps -e .
	touch $@

# make bench adds the bench extra (PyTorch, curvlinops, PyHessian: benchmarks/versus.py).
$(VENV)/.installed-bench: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test,lint,docs,bench]"
	touch $@

$(VENV)/.installed-mutation: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python $(UV_INSTALL) $(BIN)/python -e ".[test,mutation]"
	touch $@

venv install: $(VENV)/.installed-dev

run: $(VENV)/.installed-run
	$(BIN)/python -m spectra analyze data/digits_mlp.keras --data data/digits.npz \
		--loss sparse_categorical_crossentropy --top-k 5 --trace --density --out $(OUT)/analyze
	$(BIN)/python -m spectra sharpness data/gd_trajectory --data data/digits.npz \
		--loss sparse_categorical_crossentropy --out $(OUT)/sharpness
	@echo "Figures: $(OUT)/analyze/eigenvalues.png $(OUT)/analyze/density.png" \
		"$(OUT)/sharpness/sharpness.png (add --format png,pdf,svg for more formats)"

# make lint (ruff check, ruff format --check, mypy), then the suite in one pytest-xdist
# worker per core, each on one thread (tests/conftest.py); an idle worker takes tests
# from a busy one's queue (--dist worksteal), so that no worker ends long after the other.
# The JAX virtualenv is installed while the development one is, then while make lint
# runs (-j3: mostly downloads and unpacking), then the TensorFlow suite and the JAX job.
# (Running the suite and the JAX job side by side took as long in all: 9 min 24 s against
# about 9 min 20 s one after the other.)
test:
	@$(MAKE) --no-print-directory -j4 lint warm-test-cache $(JAX_VENV)/.installed-jax
	@$(MAKE) --no-print-directory test-suite
	@$(MAKE) --no-print-directory test-jax

# The test runs write bytecode even where PYTHONDONTWRITEBYTECODE is set: pytest then
# keeps its assertion-rewritten test modules (rewriting them takes each worker about 10 s
# per run), and the suite's subprocesses (the command line, notebook kernels, cluster
# workers) import spectra's compiled modules instead of compiling them each time.
WRITE_BYTECODE = env -u PYTHONDONTWRITEBYTECODE
# One collection of the suite while make lint runs and the JAX virtualenv installs (the
# cores are mostly idle then): it writes the rewritten test modules and spectra's
# bytecode, which the suite's workers and subprocesses then read instead of each making
# its own.
warm-test-cache: $(VENV)/.installed-dev
	@$(WRITE_BYTECODE) $(BIN)/python -m pytest -q --collect-only -p no:cacheprovider > /dev/null \
	|| echo "(collecting the suite failed: make test-suite will say why)"

# make test leaves out the few tests marked long: each takes seconds and covers what a
# faster test in the run covers too (the recurrent zoo entries but the SimpleRNN, the
# localhost cluster, the k = 3 eigenvalue-bound sweeps, a compiled LSTM checkpoint);
# make test-all runs everything.
SUITE_SELECTION ?= -m "not long"
test-suite: $(VENV)/.installed-dev
	$(WRITE_BYTECODE) $(BIN)/python -m pytest -q -n auto --dist worksteal --timeout=900 \
		$(SUITE_SELECTION)

test-all:
	@$(MAKE) --no-print-directory test SUITE_SELECTION=

# Keras on JAX without TensorFlow (KERAS_BACKEND=jax): the JAX engine's tests (tests/jax_engine,
# whose conftest.py is the only one read: --confcutdir) and make run's analysis.
test-jax: $(JAX_VENV)/.installed-jax
	KERAS_BACKEND=jax $(WRITE_BYTECODE) $(JAX_BIN)/python -m pytest -q -n auto --timeout=900 \
		--confcutdir=tests/jax_engine -p no:cacheprovider tests/jax_engine
	KERAS_BACKEND=jax $(JAX_BIN)/python -m spectra analyze data/digits_mlp.keras \
		--data data/digits.npz --loss sparse_categorical_crossentropy --top-k 5 --trace \
		--out $(OUT)/jax-analyze

test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -m "not slow"

format-check: $(VENV)/.installed-dev
	$(BIN)/ruff format --check $(LINTED)

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

ruff-check: $(VENV)/.installed-dev
	$(BIN)/ruff check $(LINTED)

lint: ruff-check format-check typecheck

# -E: a fresh build every time, so that every page's warnings are seen (an incremental
# build rereads only what changed); docstring markup problems are warnings too.
docs: $(VENV)/.installed-dev
	$(BIN)/python -m sphinx -E -W --keep-going -q -b html docs $(OUT)/site

bench: $(VENV)/.installed-bench $(JAX_VENV)/.installed-jax
	$(BIN)/python benchmarks/hvp_speed.py
	$(BIN)/python benchmarks/backends.py --jax-python $(JAX_BIN)/python --json $(OUT)/backends.json
	$(BIN)/python benchmarks/zoo_speed.py
	$(BIN)/python benchmarks/estimators_digits.py
	$(BIN)/python benchmarks/pyhessian_compare.py
	$(BIN)/python benchmarks/memory_streaming.py
	$(BIN)/python benchmarks/memory_plan.py --json $(OUT)/memory_plan.json
	$(BIN)/python benchmarks/trajectory.py
	$(BIN)/python benchmarks/cli_help.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/approximations.py
	$(BIN)/python benchmarks/language_models.py --json $(OUT)/language_models.json
	$(BIN)/python benchmarks/kfac_large_layers.py --json $(OUT)/kfac_large_layers.json
	$(BIN)/python benchmarks/product_ops.py --json $(OUT)/product_ops.json
	$(BIN)/python benchmarks/scale.py --json $(OUT)/scale.json
	$(BIN)/python benchmarks/versus.py --markdown $(OUT)/versus.md --json $(OUT)/versus.json

# The reduced scale benchmark: ResNet-20 at 256 images and the GPT at 128 sequences.
bench-quick: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/scale.py --quick --json $(OUT)/scale-quick.json

# Not part of make test: about 2.5 hours on 2 cores (see tests/MUTANTS.md).
mutate: $(VENV)/.installed-mutation
	$(BIN)/python .ci/mutate.py --out $(OUT)/mutation

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache .mypy_cache mutants docs/_build
