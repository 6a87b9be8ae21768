# syntax=docker/dockerfile:1
# CPU image: the project on Python 3.11 with the tritonserver of the nvidia-pytriton wheel, the server that
# `make serve` and CI run. Build from the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t triton-vlm:cpu .
# Run, the checkpoint and the LoRA adapters mounted (never baked in):
#   docker run --shm-size 2g -p 8000-8002:8000-8002 -p 9000:9000 \
#     -v /path/to/llava-checkpoint:/models/llava:ro -v /path/to/adapters:/adapters:ro \
#     triton-vlm:cpu --model /models/llava --lora-dir /adapters
# Without --model it builds and serves the demo model (in /cache).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG UID=1000
# a wheel index for torch (e.g. PyTorch's CPU-only one, for a smaller image); empty: the package registry
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    TRITON_VLM_CACHE=/cache HF_HOME=/cache/huggingface

# tritonserver links the system's zlib and libstdc++; torch and onnxruntime use libgomp; the llm's decode kernels
# (src/triton_vlm/engine/cpu/: gemv, cpu_decode, cpu_forward; csrc/*.c) are compiled by gcc at the first start, for the
# CPU the container runs on
RUN apt-get update \
 && apt-get install -y --no-install-recommends zlib1g libstdc++6 libgomp1 gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

COPY . /opt/triton-vlm
RUN TORCH_INDEX_URL="${TORCH_INDEX_URL}" bash /opt/triton-vlm/deploy/docker/install.sh --python python3 \
 && useradd --uid "${UID}" --create-home --shell /usr/sbin/nologin triton-vlm \
 && mkdir -p /cache /models /adapters \
 && chown "${UID}:${UID}" /cache

USER ${UID}
# the tritonserver tree for this Python, copied into the cache at build (an empty /cache volume gets it at start)
RUN python3 -c "from triton_vlm.server.install import prepare_server_tree; prepare_server_tree()"

# HTTP, gRPC, Prometheus metrics, the OpenAI-compatible API
EXPOSE 8000 8001 8002 9000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8000/v2/health/ready', timeout=2)"]
# Every port on every interface of the container: Docker and Kubernetes forward a published port to the
# container's own address, never to its loopback. So the launcher wants an API key (-e TRITON_VLM_API_KEY=KEY) or
# an explicit --insecure, and without either refuses to start, saying so (README: The API key).
ENV TRITON_VLM_HOST=0.0.0.0
ENTRYPOINT ["triton-vlm-serve"]
CMD ["--log-file", "-"]
