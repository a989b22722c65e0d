# Every target creates .venv and installs the project into it on first use.
#
# ArviZ 1.x and JAX >= 0.11 need Python >= 3.12, so .venv is made with the first Python
# >= 3.12 found: python3.12 or python3.13 on PATH, then pyenv's installed versions (oldest
# first: 3.12 is the tested one), then python3 if it is new enough.
# `make PYTHON=/path/to/python` chooses another.

ifeq ($(origin PYTHON), undefined)
PYTHON := $(shell for p in python3.12 python3.13 \
	$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9].*/bin/python 2>/dev/null | sort -V) python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(not sys.version_info >= (3, 12))' 2>/dev/null \
	&& { command -v $$p; break; }; done)
endif
# Python 3.10/3.11 users get ArviZ 0.2x and JAX <= 0.10: `make test-compat` tests that stack.
ifeq ($(origin COMPAT_PYTHON), undefined)
COMPAT_PYTHON := $(shell for p in python3.11 python3.10 \
	$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[01].*/bin/python 2>/dev/null | sort -rV) python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info < (3, 12)))' 2>/dev/null \
	&& { command -v $$p; break; }; done)
endif
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
COMPAT_VENV := .venv-compat
DATA ?= ../shared/data

.PHONY: demo test test-long test-engine lint test-slow test-ci-slow test-compat zoo docs notebooks bench clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: no Python >= 3.12 found (tried python3.12, python3.13," \
	  "pyenv's versions and python3). Install Python 3.12 or newer (e.g. 'apt-get install" \
	  "python3.12-venv' or 'pyenv install 3.12'), or run make PYTHON=/path/to/python3.12" >&2; exit 1; }
	@if [ -x $(PY) ] && [ "$$($(PY) -c 'import sys; print(sys.version_info[:2])')" != \
	  "$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])')" ]; then \
	  echo "make: $(VENV) has $$($(PY) -V), not $$($(PYTHON) -V): making it anew"; rm -rf $(VENV); fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test,docs,notebooks,ray,flower]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py --data $(DATA)

# The package's tests in this process, the long ones and the engine ones apart
test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 -m "not slow and not engine and not long" --durations=25

# What make test leaves out (marked in tests/conftest.py): the tests that start Ray workers or
# Flower's simulation (a local Ray, stopped at the end) and the correctness checks of more than
# about 10 s each. 183 tests, 36 min 21 s on an idle 2-core machine (2 December 2026).
test-long: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "(engine or long) and not slow" --durations=25

# What CI runs of test-long: the engine tests that are not also long (every algorithm on a
# local Ray and on Flower's simulation, against the in-process run). 41 tests, 10 min 31 s
# on an idle 2-core machine (2 December 2026); the long correctness checks are for make test-long.
test-engine: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "engine and not long and not slow" --durations=25

# ruff: pyflakes, pycodestyle, import order and the format (pyproject.toml's [tool.ruff])
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 -m slow

# The slow tests CI runs (the whole slow tier, the zoo's 76 runs above all, would take CI past
# its hour): the Flower deployment on localhost and `flwr run`'s simulation, the Ray example,
# the README's example in float32 and the "Run across machines" page. One at a time: each
# starts its own Ray or Flower. 8 minutes measured on a loaded 2-core machine.
SLOW_CI := tests/flower/test_flower_deployment.py tests/test_examples.py tests/test_readme.py \
	tests/federation/test_federation.py
test-ci-slow: $(STAMP)
	$(PY) -m pytest -q -n 0 -m slow --durations=10 $(SLOW_CI)

# The conversion to ArviZ 0.2x (with JAX 0.10) on Python 3.10/3.11, the stack users of
# those Pythons get; in $(COMPAT_VENV). Without the ray extra: the tests that need Ray skip.
test-compat:
	@test -n "$(COMPAT_PYTHON)" || { echo "make: no Python 3.10 or 3.11 found for test-compat;" \
	  "run make COMPAT_PYTHON=/path/to/python3.11" >&2; exit 1; }
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q -e ".[test,notebooks]"
	$(COMPAT_VENV)/bin/python -m pytest -q -n 2 -p no:cacheprovider tests/test_arviz.py numpyro_fed/arviz.py

# The model zoo: every algorithm x every model, default settings; writes docs/guide/zoo.md.
# TIER=real runs the real-model tier only (published models on real data, tests/zoo/real_models.py;
# its UCI models read $(DATA)), TIER=synthetic the synthetic zoo only; by default both.
TIER ?= all
zoo: $(STAMP)
	@status=0; \
	if [ "$(TIER)" != real ]; then $(PY) tools/zoo_table.py --jobs 2 || status=1; fi; \
	if [ "$(TIER)" != synthetic ]; then ZOO_DATA=$(DATA) $(PY) tools/zoo_table.py --tier real --jobs 2 || status=1; fi; \
	exit $$status

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

notebooks: $(STAMP)
	$(PY) tools/run_notebooks.py notebooks/*.ipynb

clean:
	rm -rf $(VENV) $(COMPAT_VENV) site .pytest_cache .jax_cache
