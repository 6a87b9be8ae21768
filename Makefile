# make serve: start Triton on the demo model (or MODEL=/path/to/llava-checkpoint) and answer a request.
# make test:  the whole test suite against a live server.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test demo bench install clean

$(STAMP): pyproject.toml client/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,bench]" -e ./client
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m triton_vlm.demo

serve: $(STAMP)
	$(PY) -m triton_vlm.serve

test: $(STAMP)
	$(PY) -m triton_vlm.demo $(if $(CI),--quiet,)
	$(PY) -m pytest -q -ra tests

bench: $(STAMP)
	$(PY) -m bench.throughput

clean:
	rm -rf $(VENV) build *.egg-info
