# tinygw: every target installs what it needs from the locks (requirements/*.lock).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all demo test fuzz bench soak lock clean build reproduce test-frozen

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

# tests/test_frozen.py runs against build/dist/tinygw, which may predate the sources: `make test-frozen`.
test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/test_frozen.py

# The fuzz tests with many more examples, from a random seed (`make test` runs a few, derandomized).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/test_fuzz.py

# build/dist/tinygw and build/dist/release.json (SPEC section 8); see build/build.sh.
build: $(STAMP)
	sh build/build.sh

# Two builds from two temporary copies of the tree must be byte-identical.
reproduce: $(STAMP)
	$(PY) build/reproduce.py

# Build, then test the executable: its own tests, then every suite against it (TINYGW_BINARY).
test-frozen: build
	$(PY) -m pytest -q tests/test_frozen.py
	TINYGW_BINARY=$(CURDIR)/build/dist/tinygw $(PY) -m pytest -q --ignore=tests/test_frozen.py

bench: $(STAMP)
	$(PY) bench/run.py

# A bounded chaos soak on loopback (not part of `make test`): `make soak SOAK_SECONDS=60`.
SOAK_SECONDS ?= 180
soak: $(STAMP)
	$(PY) bench/soak.py --seconds $(SOAK_SECONDS)

# Re-pin after editing requirements/*.in (needs network access to the package index).
lock:
	$(PYTHON) -m pip install --quiet uv
	cd requirements && $(PYTHON) -m uv pip compile -q --python-version 3.11 --generate-hashes --no-header runtime.in -o runtime.lock
	cd requirements && $(PYTHON) -m uv pip compile -q --python-version 3.11 --generate-hashes --no-header dev.in -o dev.lock

clean:
	rm -rf $(VENV) .pytest_cache build/dist build/work
