# tinygw: every target installs what it needs from the locks (requirements/*.lock).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROJECT := $(VENV)/.project

.PHONY: all demo test test-clients lint fuzz bench bench-floor bench-outage bench-agents bench-overhead bench-neighbours bench-streams bench-interfaces soak verifier rehearse lock clean build reproduce release-check test-frozen

# The virtualenv and the `tinygw` command in it (.venv/bin/tinygw).
all: $(STAMP) $(PROJECT)

# The virtualenv, from the hashed locks alone: runtime and test dependencies.
$(STAMP): requirements/runtime.lock requirements/dev.lock requirements/verify.lock
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "tinygw needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
		-r requirements/runtime.lock -r requirements/dev.lock -r requirements/verify.lock
	@touch $(STAMP)

# tinygw itself, editable (the venv runs this clone's sources): no download, no dependency resolved,
# built by the lock's setuptools (pyproject.toml's build backend) already in the venv.
$(PROJECT): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-build-isolation -e .
	@touch $(PROJECT)

demo: $(STAMP)
	$(PY) -m tinygw demo

# tests/test_frozen.py runs against build/dist/tinygw, which may predate the sources: `make test-frozen`.
# The tinygw command is in .venv too: docs' shell snippets are run as a newcomer runs them.
test: $(STAMP) $(PROJECT)
	$(PY) -m pytest -q --ignore=tests/test_frozen.py

# Linters: ruff's checks and format, mypy on tinygw/, and the import layers of pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy tinygw
	$(VENV)/bin/lint-imports

# One prompt from Claude Code, the Codex CLI and llm each, through a gateway and `tinygw fake`
# (tests/clients/agents.py), in a network namespace where only loopback exists. The clients
# are pinned: npm's lock (binaries inside the npm packages, no install scripts run) and a
# hashed lock for llm's own venv, both in ignored folders under tests/clients/.
CLIENTS := tests/clients
test-clients: $(STAMP) $(CLIENTS)/.node/.installed $(CLIENTS)/.venv-llm/.installed
	timeout 900 $(CLIENTS)/offline.sh $(PY) -m pytest -q -p no:cacheprovider $(CLIENTS)/agents.py

$(CLIENTS)/.node/.installed: $(CLIENTS)/package.json $(CLIENTS)/package-lock.json
	mkdir -p $(CLIENTS)/.node
	cp $(CLIENTS)/package.json $(CLIENTS)/package-lock.json $(CLIENTS)/.node/
	cd $(CLIENTS)/.node && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	@touch $@

$(CLIENTS)/.venv-llm/.installed: $(CLIENTS)/llm.lock
	$(PYTHON) -m venv $(CLIENTS)/.venv-llm
	$(CLIENTS)/.venv-llm/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
		-r $(CLIENTS)/llm.lock
	@touch $@

# The fuzz tests with many more examples, from a random seed (`make test` runs a few, derandomized).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/test_fuzz_units.py tests/test_fuzz_gateway.py tests/test_fastpath.py

# build/dist/tinygw and build/dist/release.json (docs/design.md section 8), built inside a Debian build
# root from pinned packages and the locks: needs root and apt, not .venv; see build/build.sh.
build:
	sh build/build.sh

# Two builds from two fresh build roots, two copies of the tree and two host Pythons first on
# PATH must be byte-identical. REFERENCE=path/to/release.json instead rebuilds that release (its
# source_commit, from its own package manifest: each .deb from the host's mirror, else
# DEBIAN_SNAPSHOT's archive, else DEBS_DIR) and compares: exit 0 when identical.
reproduce: $(STAMP)
	$(PY) build/reproduce.py $(if $(REFERENCE),--reference $(REFERENCE))

# The release's build root against the mirror's bookworm, bookworm-updates and bookworm-security
# now: each package with a newer version is named, and exit 1 says to cut a new release.
RELEASE ?= release/release.json
release-check:
	sh build/buildroot.sh check $(RELEASE)

# Build, then test the executable: its own tests, then every suite against it (TINYGW_BINARY).
test-frozen: build $(STAMP) $(PROJECT)
	$(PY) -m pytest -q tests/test_frozen.py
	TINYGW_BINARY=$(CURDIR)/build/dist/tinygw $(PY) -m pytest -q --ignore=tests/test_frozen.py

# attest/verify's own environment, from its lock alone (dcap-qvl, cryptography): for clients and auditors.
verifier: .venv-verify/.installed
.venv-verify/.installed: requirements/verify.lock
	$(PYTHON) -m venv .venv-verify
	.venv-verify/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
		-r requirements/verify.lock
	@touch $@
	@echo "run the verifier as: .venv-verify/bin/python attest/verify --help"

# The whole attested flow, SIMULATED (no TDX here): launch, attested TLS, verify stopping at UNVERIFIED, then
# a SIMULATED signature check pinning the certificate, a pinned client, a relay caught; then an SEV-SNP round,
# SIMULATED too (a test-only chain, not AMD's: its check is a SKIP, never a PASS).
rehearse: $(STAMP)
	$(PY) attest/rehearse

# Plain, then streamed answers: tinygw beside nginx, LiteLLM's proxy, Portkey's gateway and TensorZero's
# (the peers are installed on first use into bench/.venv-litellm, bench/.node-portkey and
# bench/.venv-tensorzero); then the bytecodes a request and an event cost (exact, whatever the noise);
# about 10 minutes in all.
bench: $(STAMP)
	$(PY) bench/run.py
	$(PY) bench/run.py --stream
	$(PY) bench/bytecodes.py
	$(PY) bench/artifact.py

# The latency each gateway adds, as independent harnesses measure it: sequential requests, direct and
# every gateway interleaved, rounds after a warm-up, median of the round medians (~2 min).
bench-overhead: $(STAMP)
	$(PY) bench/overhead.py

# The floor under `make bench`: Granian alone, Granian + tinygw's upstream pool, the pool on one
# uvloop thread, and tinygw, side by side (~4 min).
bench-floor: $(STAMP)
	$(PY) bench/floor.py

# What a provider outage costs the clients (refused/reset, hang, 500, then recovery), tinygw beside
# LiteLLM and Portkey (installed on first use, as for `make bench`): ~10 min. `make bench-outage WORKERS=4`
# also runs tinygw with 4 workers, its hits on the failing primary beside the one worker's.
bench-outage: $(STAMP)
	$(PY) bench/outage.py $(if $(WORKERS),--workers $(WORKERS))

# Agents keep their prompt cache: 16 sessions of 40 turns in Claude Code's shape through a round_robin alias
# of two targets on a provider with three keys, to the fake provider's prompt cache, with conversation
# affinity on and off (bench/agents.py; loopback only, a few seconds).
bench-agents: $(STAMP)
	$(PY) bench/agents.py

# No client can hurt another: 16 well-behaved clients beside a hostile one that tries each attack in
# turn (unencodable query, account headers, junk model names, streams it never reads, over its limits),
# a fresh gateway per attack, 3 rounds; success, p99 with and without it, circuits it opened (~4 min).
bench-neighbours: $(STAMP)
	$(PY) bench/neighbours.py

# Thousands of long streams at once (a paced upstream: 200 events, one every 50 ms), C = 100 to 3,000:
# direct, tinygw at its defaults, nginx, TensorZero, Portkey and LiteLLM (the last two to 1,000), then a
# slow-reader lane; the peers are installed on first use, as for `make bench`: ~15 min.
bench-streams: $(STAMP)
	$(PY) bench/streams.py

# Granian's RSGI interface against its ASGI one on the streams workload: the same bare relay
# (tinygw's upstream pool, a send per read) on each, and tinygw itself beside them, with the goal
# of its CPU per event against the bare ASGI relay's; C=1,000, 3 rounds in turn (3 to 5 min).
bench-interfaces: $(STAMP)
	$(PY) bench/interfaces.py

# A bounded chaos soak on loopback (not part of `make test`): `make soak SOAK_SECONDS=60`.
SOAK_SECONDS ?= 180
soak: $(STAMP)
	$(PY) bench/soak.py --seconds $(SOAK_SECONDS)

# Re-pin after editing requirements/*.in (needs network access to the package index).
lock:
	$(PYTHON) -m pip install --quiet uv
	cd requirements && $(PYTHON) -m uv pip compile -q --python-version 3.11 --generate-hashes --no-header runtime.in -o runtime.lock
	cd requirements && $(PYTHON) -m uv pip compile -q --python-version 3.11 --generate-hashes --no-header dev.in -o dev.lock
	cd requirements && $(PYTHON) -m uv pip compile -q --python-version 3.11 --generate-hashes --no-header verify.in -o verify.lock
	cd $(CLIENTS) && $(PYTHON) -m uv pip compile -q --python-version 3.11 --generate-hashes --no-header llm.in -o llm.lock
	cd $(CLIENTS) && npm install --package-lock-only --ignore-scripts --no-audit --no-fund

clean:
	rm -rf $(VENV) .venv-verify .pytest_cache .mypy_cache .ruff_cache build/dist build/work $(CLIENTS)/.node $(CLIENTS)/.venv-llm
