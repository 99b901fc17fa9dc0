# The two commands of the README:
#   make run   - set up .venv and analyze the embedded example model in data/
#   make test  - set up .venv and run the test suite
# Tool versions (ruff, mypy) and the docs' dependencies are pinned in setup.cfg's extras only.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out
LINTED := spectra tests benchmarks data notebooks docs .ci
.PHONY: help venv install run test test-fast lint ruff-check format-check typecheck docs bench bench-quick mutate clean

help:
	@echo "make run       analyze the example checkpoint in data/ (writes $(OUT)/)"
	@echo "make test      make lint, then the test suite"
	@echo "make lint      ruff check, ruff format --check and mypy (make typecheck)"
	@echo "make docs      build the documentation site into $(OUT)/site (warnings are errors)"
	@echo "make bench     run the benchmarks (ratios to a compiled gradient)"
	@echo "make bench-quick  the reduced scale benchmark (ResNet-20, small GPT; about 10 min)"
	@echo "make mutate    mutation testing of the numerical core (long; report in $(OUT)/mutation/)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Re-install when the package metadata changes. One stamp per set of extras:
# the package alone (make run), development (tests, lint tools, docs), mutation testing.
$(VENV)/.installed-run: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test,lint,docs]"
	touch $@

$(VENV)/.installed-mutation: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test,mutation]"
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
test: lint
	$(BIN)/python -m pytest -q -n auto --dist worksteal --timeout=900

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

bench: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/hvp_speed.py
	$(BIN)/python benchmarks/zoo_speed.py
	$(BIN)/python benchmarks/estimators_digits.py
	$(BIN)/python benchmarks/pyhessian_compare.py
	$(BIN)/python benchmarks/memory_streaming.py
	$(BIN)/python benchmarks/trajectory.py
	$(BIN)/python benchmarks/cli_help.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/approximations.py
	$(BIN)/python benchmarks/product_ops.py --json $(OUT)/product_ops.json
	$(BIN)/python benchmarks/scale.py --json $(OUT)/scale.json

# The reduced scale benchmark: ResNet-20 at 256 images and the GPT at 128 sequences.
bench-quick: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/scale.py --quick --json $(OUT)/scale-quick.json

# Not part of make test: about 2.5 hours on 2 cores (see tests/MUTANTS.md).
mutate: $(VENV)/.installed-mutation
	$(BIN)/python .ci/mutate.py --out $(OUT)/mutation

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache .mypy_cache mutants docs/_build
