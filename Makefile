# tinygw: every target installs what it needs from the locks (requirements/*.lock).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all demo test bench lock clean

all: $(STAMP)

# The virtualenv, from the hashed locks alone: runtime and test dependencies.
$(STAMP): requirements/runtime.lock requirements/dev.lock
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "tinygw needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
		-r requirements/runtime.lock -r requirements/dev.lock
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tinygw demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/run.py

# Re-pin after editing requirements/*.in (needs network access to the package index).
lock:
	$(PYTHON) -m pip install --quiet uv
	cd requirements && $(PYTHON) -m uv pip compile -q --python-version 3.11 --generate-hashes --no-header runtime.in -o runtime.lock
	cd requirements && $(PYTHON) -m uv pip compile -q --python-version 3.11 --generate-hashes --no-header dev.in -o dev.lock

clean:
	rm -rf $(VENV) .pytest_cache
