# Developer entry points. `make test` is the README's test command; .ci/run calls it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# `make test` runs the suite in two pytest processes side by side (scripts/run_tests.py);
# `make test TESTS=tests/test_cli.py` runs plain pytest on a part of it
TESTS ?=

.PHONY: venv shim test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

venv: $(PY)
	$(PY) -m pip install -q -e '.[test]'

shim:
	$(MAKE) -C cuda_shim

test: venv shim
	@# the shim's test programs too, before two pytest processes would both ask make for them
	$(MAKE) -s -C cuda_shim tests
	$(PY) scripts/run_tests.py $(TESTS)

lint: venv
	$(PY) -m ruff check dilu_invoker tests bench
	$(PY) -m mypy dilu_invoker

clean:
	rm -rf $(VENV) build *.egg-info
	$(MAKE) -C cuda_shim clean
