# Every target creates .venv and installs the project into it on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DATA ?= ../shared/data

.PHONY: demo test test-slow zoo docs notebooks bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test,docs,notebooks]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py --data $(DATA)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 -m slow

# The model zoo: every algorithm x every model, default settings; writes docs/guide/zoo.md.
zoo: $(STAMP)
	$(PY) tools/zoo_table.py --jobs 2

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

notebooks: $(STAMP)
	$(PY) tools/run_notebooks.py notebooks/*.ipynb

clean:
	rm -rf $(VENV) site .pytest_cache
