# rlflow: two commands for a new machine.
#   make demo   install into .venv if needed, start the local services, run the demo, print where to look
#   make test   install what the tests need, run the whole suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlflow-installed

.PHONY: install demo test bench clean-venv

install: $(STAMP)

# Reinstall when the dependencies change. pip takes torch==2.13.0 (CPU) from this machine's disk.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlflow demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

bench: $(STAMP)
	$(PY) bench/dispatch.py

clean-venv:
	rm -rf $(VENV)
