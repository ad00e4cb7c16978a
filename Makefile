# Two commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo docs test test-fast lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

# The user guide (docs/, mkdocs.yml); --strict: a broken link or anchor fails the build.
docs: setup
	$(PY) -m mkdocs build --strict --site-dir site

test: setup docs
	$(PY) -m pytest -q --durations=25

test-fast: setup
	$(PY) -m pytest -q -m "not engine"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf out site .pytest_cache .ruff_cache
