# The two commands of the README:
#   make run   - set up .venv and analyze the embedded example model in data/
#   make test  - set up .venv and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out
.PHONY: help venv install run test test-fast lint bench mutate clean

help:
	@echo "make run    analyze the example checkpoint in data/ (writes $(OUT)/)"
	@echo "make test   run the test suite"
	@echo "make bench  run the benchmarks (ratios to a compiled gradient)"
	@echo "make mutate mutation testing of the numerical core (long; report in $(OUT)/mutation/)"
	@echo "make lint   ruff"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Re-install when the package metadata changes.
$(VENV)/.installed: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

venv install: $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/python -m spectra analyze data/digits_mlp.keras --data data/digits.npz \
		--loss sparse_categorical_crossentropy --top-k 5 --trace --density --out $(OUT)/analyze
	$(BIN)/python -m spectra sharpness data/gd_trajectory --data data/digits.npz \
		--loss sparse_categorical_crossentropy --out $(OUT)/sharpness
	@echo "Figures: $(OUT)/analyze/eigenvalues.png $(OUT)/analyze/density.png" \
		"$(OUT)/sharpness/sharpness.png (add --format png,pdf,svg for more formats)"

test: $(VENV)/.installed
	$(BIN)/ruff check spectra tests benchmarks data notebooks
	$(BIN)/python -m pytest -q --timeout=900

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(VENV)/.installed
	$(BIN)/ruff check spectra tests benchmarks data notebooks

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/hvp_speed.py
	$(BIN)/python benchmarks/zoo_speed.py
	$(BIN)/python benchmarks/estimators_digits.py
	$(BIN)/python benchmarks/pyhessian_compare.py
	$(BIN)/python benchmarks/memory_streaming.py
	$(BIN)/python benchmarks/trajectory.py
	$(BIN)/python benchmarks/cli_help.py
	$(BIN)/python benchmarks/scaling.py

# Not part of make test: about N hours on 2 cores (see tests/MUTANTS.md).
mutate: $(VENV)/.installed
	$(BIN)/python .ci/mutate.py --out $(OUT)/mutation

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache mutants
