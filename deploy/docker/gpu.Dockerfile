# syntax=docker/dockerfile:1
# GPU image on NVIDIA's Triton container (its tritonserver, CUDA, TensorRT and a python backend built for its
# Python); the release is the one docker-compose.yml names (tests/test_deploy.py checks they agree). Build from
# the repository root:
#   docker build -f deploy/docker/gpu.Dockerfile -t triton-vlm:gpu .
# Run, the checkpoint and the LoRA adapters mounted (never baked in):
#   docker run --gpus all --shm-size 2g -p 8000-8002:8000-8002 -p 9000:9000 \
#     -v /path/to/llava-1.5-7b-hf:/models/llava:ro -v /path/to/adapters:/adapters:ro \
#     triton-vlm:gpu --model /models/llava --lora-dir /adapters
# The vision encoder runs as a TensorRT plan built on the first start and cached in /cache by checkpoint content
# (mount a volume there to keep it); --set vision.vision_backend=torch skips TensorRT.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:26.10-py3
FROM ${TRITON_IMAGE}

ARG UID=1000
# The container's Python is the python backend's: install into it (PyPI's Linux torch wheel is the CUDA build).
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    TRITON_VLM_CACHE=/cache HF_HOME=/cache/huggingface \
    TRITONSERVER=/opt/tritonserver/bin/tritonserver DEVICE=cuda

COPY . /opt/triton-vlm
# uid 1000 may already exist in the base image (NVIDIA's `triton-server` user): it is used as it is
RUN bash /opt/triton-vlm/deploy/docker/install.sh --python python3 --gpu \
 && (getent passwd "${UID}" >/dev/null || useradd --uid "${UID}" --create-home --shell /usr/sbin/nologin triton-vlm) \
 && mkdir -p /cache /models /adapters \
 && chown "${UID}" /cache

USER ${UID}

# HTTP, gRPC, Prometheus metrics, the OpenAI-compatible API
EXPOSE 8000 8001 8002 9000
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["curl", "-sf", "localhost:8000/v2/health/ready"]
# Every port on every interface of the container: Docker and Kubernetes forward a published port to the
# container's own address, never to its loopback. So the launcher wants an API key (-e TRITON_VLM_API_KEY=KEY) or
# an explicit --insecure, and without either refuses to start, saying so (README: The API key).
ENV TRITON_VLM_HOST=0.0.0.0
ENTRYPOINT ["triton-vlm-serve"]
CMD ["--log-file", "-", "--set", "llm.dtype=float16", "--set", "vision.vision_backend=tensorrt"]
