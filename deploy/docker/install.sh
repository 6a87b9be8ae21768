#!/usr/bin/env bash
# The one install of triton-vlm. `make install` (so `make test` and CI), the CPU image and the GPU image all run
# this script, so what the images run is what CI tests.
#
#   deploy/docker/install.sh [--python PY] [--extras test,bench] [--gpu]
#
# --python   the interpreter to install into (default: python3; `make` passes its venv's python)
# --extras   optional dependency groups of pyproject.toml (default: none; `make` asks for test,bench)
# --gpu      also the TensorRT Python package (the vision encoder's TensorRT plan is built and run with it)
#
# The project is installed editable from the checkout this script lives in: the launcher reads
# model_repository/ from the checkout (triton_vlm.paths.REPO_ROOT). TORCH_INDEX_URL, if set, is the wheel index
# torch is taken from (e.g. PyTorch's CPU-only index for a smaller CPU image); unset: the package registry.
set -euo pipefail

# torch first and pinned (pyproject.toml pins the same version; tests/test_deploy.py checks they agree): an
# unpinned torch pulled in by another package would be a multi-GB CUDA build.
TORCH_VERSION=2.13.0

python=python3
extras=""
gpu=0
while [ $# -gt 0 ]; do
    case "$1" in
        --python) python="$2"; shift 2 ;;
        --extras) extras="$2"; shift 2 ;;
        --gpu) gpu=1; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
pip=("$python" -m pip install -q)

# a pip installed by the OS package manager cannot be upgraded by pip: keep it then
"${pip[@]}" --upgrade pip || echo "install.sh: pip not upgraded; continuing with $("$python" -m pip --version)"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
    "${pip[@]}" "torch==$TORCH_VERSION"
fi
"${pip[@]}" -e "$root${extras:+[$extras]}" -e "$root/client"
if [ "$gpu" = 1 ]; then
    "${pip[@]}" tensorrt
fi
