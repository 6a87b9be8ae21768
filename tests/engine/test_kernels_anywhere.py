"""The CPU kernels on any machine (`engine/cpu/cbuild.py`, `csrc/*.c`): the sources compile without a warning for
every x86-64 level (no ABI-changing vector returns), an AVX2 machine gets the AVX-512 machine's bits, every
kernel runs clean under AddressSanitizer + UBSan, the llm loads where the python stub's locale is ASCII and the
compiler prints bytes it cannot decode, and a kernel is used only where it won its race against torch."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import triton_vlm
from triton_vlm.engine.cpu import gemm
from triton_vlm.engine.cpu import cbuild, cpu_forward, gemv

PROBE = Path(__file__).with_name("kernel_probe.py")
X86 = platform.machine() in ("x86_64", "AMD64")
CC = shutil.which(os.environ.get("CC", "cc"))
FORCED = {"TRITON_VLM_CPU_GEMV": "1", "TRITON_VLM_CPU_DECODE": "1", "TRITON_VLM_CPU_FORWARD": "1"}

NO_KERNEL = "C kernel not built here: no C compiler or no usable gemv; oneDNN runs every product, nothing to race"


def _cpu_flags() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x for x in lines if x.startswith(("flags", "Features"))), "")


def _probe(*args: str, env: dict, timeout: int = 300, python_flags: tuple[str, ...] = ()) -> tuple[int, str, dict]:
    """Run kernel_probe.py in a fresh interpreter with `env` over a clean environment -> (rc, output, RESULT)."""
    proc = subprocess.run([sys.executable, *python_flags, str(PROBE), *args], env=env, capture_output=True,
                          timeout=timeout)
    out = (proc.stdout + proc.stderr).decode("utf-8", errors="replace")
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    return proc.returncode, out, json.loads(line[7:]) if line else {}


def _env(tmp_path: Path, **extra: str) -> dict:
    keep = ("PATH", "HOME", "LD_LIBRARY_PATH", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(TRITON_VLM_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(Path(triton_vlm.__file__).parents[1]), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


LEVELS = ["native", "x86-64-v4", "x86-64-v3", "x86-64-v2", "x86-64"] if X86 else ["native"]


@pytest.mark.parametrize("march", LEVELS)
@pytest.mark.parametrize("source", ["gemv.c", "decode.c", "forward.c", "gemv_fp8.c", "gemv_bf16.c"])
def test_every_source_compiles_without_a_warning(tmp_path, source, march):
    assert CC is not None, "the CI machines and the images have a C compiler (deploy/docker)"
    proc = subprocess.run([CC, "-O3", f"-march={march}", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
                           "-shared", "-fPIC", f"-I{cbuild.CSRC}", "-o", str(tmp_path / "k.so"),
                           str(cbuild.CSRC / source), "-lm"], capture_output=True)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stderr.decode(errors="replace")


def test_an_avx2_machine_gets_the_same_bits(tmp_path):
    """oneDNN limited to AVX2 and the kernels built for x86-64-v3 (an AVX2 machine without AVX-512, as the EPYC
    of the issue): every kernel checks against torch there, and gives the native build's bits (its sums run in
    the same lane order at every vector width). Elsewhere (ARM): the native build alone."""
    avx2_machine = X86 and " avx2" in _cpu_flags() and " fma" in _cpu_flags()
    with ThreadPoolExecutor(2) as pool:  # the two builds side by side (their own caches)
        native_run = pool.submit(_probe, "check", str(tmp_path / "native.pt"), env=_env(tmp_path / "n", **FORCED))
        avx2_run = pool.submit(_probe, "check", str(tmp_path / "avx2.pt"), env=_env(
            tmp_path / "a", ONEDNN_MAX_CPU_ISA="AVX2", TRITON_VLM_CFLAGS="-march=x86-64-v3", **FORCED)) \
            if avx2_machine else None
        rc, out, native = native_run.result()
        assert rc == 0 and native, out[-3000:]
        if avx2_run is None:
            pytest.skip("not an x86-64 machine with AVX2 and FMA: the native build alone was checked (it passed)")
        rc, out, avx2 = avx2_run.result()
    assert rc == 0 and avx2 == native == {"gemv": True, "decode": True, "forward": True}, out[-3000:]
    a, b = torch.load(tmp_path / "native.pt"), torch.load(tmp_path / "avx2.pt")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _sanitizer_env(tmp_path: Path) -> dict:
    libs = [subprocess.run([CC, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
            for lib in ("libasan.so", "libubsan.so")]
    assert all(Path(p).is_file() for p in libs), f"gcc's sanitizer runtimes: {libs}"
    return _env(tmp_path, LD_PRELOAD=" ".join(libs), ASAN_OPTIONS="detect_leaks=0",
                TRITON_VLM_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer",
                **FORCED)


def test_every_kernel_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    env = _sanitizer_env(tmp_path)
    rc, out, found = _probe("check", str(tmp_path / "asan.pt"), env=env)
    assert rc == 0 and found == {"gemv": True, "decode": True, "forward": True}, out[-3000:]
    assert "runtime error" not in out and "AddressSanitizer" not in out
    # the control: the same build, told a weight is larger than its buffer, is caught reading past it
    rc, out, found = _probe("overflow", env=env)
    assert rc != 0 and "heap-buffer-overflow" in out and not found, out[-3000:]


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    from triton_vlm.demo.checkpoint import build_random_llava

    return build_random_llava(tmp_path_factory.mktemp("anywhere") / "llava", seed=5)


def _noisy_compiler(tmp_path: Path, fail: bool) -> str:
    """A `cc` that prints what gcc prints on an AVX2 machine (UTF-8 quotes) and bytes no codec decodes, then
    compiles (or fails)."""
    cc = tmp_path / "cc"
    real = "exit 1" if fail else f'exec {CC} "$@"'
    cc.write_bytes(b"#!/bin/sh\nprintf '\\342\\200\\230-Wpsabi\\342\\200\\231 AVX512F vector return \\377\\376\\n' >&2\n"
                   + real.encode() + b"\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    return str(cc)


@pytest.fixture(scope="module")
def plain_tokens(tmp_path_factory, tiny_llava) -> list:
    """The tiny model's tokens with every kernel off (one probe for both locales)."""
    off = _env(tmp_path_factory.mktemp("off"), TRITON_VLM_CPU_GEMV="0", TRITON_VLM_CPU_DECODE="0",
               TRITON_VLM_CPU_FORWARD="0")
    rc, out, plain = _probe("engine", str(tiny_llava), env=off)
    assert rc == 0 and plain.get("tokens"), out[-3000:]
    return plain["tokens"]


@pytest.mark.parametrize("lang", [None, "C.UTF-8"])
def test_the_llm_loads_the_way_the_stub_does(tmp_path, tiny_llava, plain_tokens, lang):
    """The python stub's interpreter keeps the C locale (preferred encoding ASCII where LANG / LC_ALL are
    unset); a fresh kernel cache; a compiler that prints non-ASCII warnings: the kernels build, and the model
    generates the tokens it generates with every kernel off."""
    base = {"LANG": lang} if lang else {}
    env = _env(tmp_path, CC=_noisy_compiler(tmp_path, fail=False), PYTHONCOERCECLOCALE="0", PYTHONUTF8="0", **base)
    rc, out, found = _probe("engine", str(tiny_llava), env=env, python_flags=("-X", "utf8=0"))
    assert rc == 0 and found, out[-3000:]
    assert found["encoding"] == ("ANSI_X3.4-1968" if lang is None else "UTF-8")
    assert list((tmp_path / "cache" / "kernels").glob("gemv-*.so")), out[-3000:]  # built despite the bytes
    assert found["tokens"] == plain_tokens, out[-3000:]


def test_a_compiler_that_fails_in_bytes_leaves_the_model_loading(tmp_path, tiny_llava):
    env = _env(tmp_path, CC=_noisy_compiler(tmp_path, fail=True), PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")
    rc, out, found = _probe("engine", str(tiny_llava), env=env, python_flags=("-X", "utf8=0"))
    assert rc == 0 and len(found["tokens"]) == 6, out[-3000:]
    assert "decode gemv kernel not used: build failed: RuntimeError" in out
    assert "\ufffd" in out or "\\ufffd" in out  # the undecodable bytes, replaced (escaped by an ASCII stream)
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


@pytest.fixture
def fresh_gemv(monkeypatch, tmp_path):
    """gemv as if never loaded in this process, its own cache, the switch at its default ("auto")."""
    monkeypatch.setattr(gemv, "_once", cbuild.Once(gemv.ENV, gemv._load))
    monkeypatch.setenv("TRITON_VLM_CACHE", str(tmp_path))
    monkeypatch.delenv(gemv.ENV, raising=False)
    return tmp_path


def test_a_cache_it_cannot_write_leaves_onednn(fresh_gemv, monkeypatch, caplog):
    blocker = fresh_gemv / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRITON_VLM_CACHE", str(blocker / "cache"))  # under a file: no folder can be made
    assert gemv.kernel(gemm.pack) is None
    assert "decode gemv kernel not used: build failed: NotADirectoryError" in caplog.text


def _products_to_kernel(kernel: gemv.Kernel, monkeypatch) -> list[int]:
    seen: list[int] = []
    run = type(kernel).run
    monkeypatch.setattr(type(kernel), "run", lambda self, x, lay, bias: seen.append(x.shape[0]) or run(self, x, lay, bias))
    w = torch.randn(72, 32)
    x = torch.randn(1, 32)
    torch.testing.assert_close(gemm.linear(x, gemm.pack(w)), F.linear(x, w), rtol=1e-5, atol=1e-4)
    return seen


def test_a_kernel_slower_than_torch_here_is_not_used(fresh_gemv, monkeypatch, caplog):
    """The race decides under "auto": lost, products stay with oneDNN and the log gives both figures; "1" uses
    the checked kernel anyway (the whole forward is built on it); the race is not run again at the next load."""
    if shutil.which("cc") is None or gemv.kernel(gemm.pack) is None:  # nothing to choose: oneDNN everywhere
        assert gemv.kernel(gemm.pack) is None
        pytest.skip(NO_KERNEL)
    gemv._once.reset()
    for f in fresh_gemv.glob("kernels/*.race.json"):
        f.unlink()
    monkeypatch.setattr(gemv, "race", lambda k, pack: cbuild.Race(0.002, 0.001))
    caplog.set_level(logging.INFO)
    kernel = gemv.kernel(gemm.pack)
    assert kernel is not None and not kernel.chosen
    assert "decode gemv kernel not used: slower than oneDNN here (2.000 ms vs oneDNN 1.000 ms)" in caplog.text
    assert _products_to_kernel(kernel, monkeypatch) == []

    def no_second_race(k, pack):
        raise AssertionError("raced again")

    monkeypatch.setattr(gemv, "race", no_second_race)
    monkeypatch.setenv(gemv.ENV, "1")  # decided at load: a load with the switch at "1" uses it
    gemv._once.reset()
    forced = gemv.kernel(gemm.pack)
    assert forced.chosen and _products_to_kernel(forced, monkeypatch) == [1]
    monkeypatch.delenv(gemv.ENV)
    gemv._once.reset()
    again = gemv.kernel(gemm.pack)
    assert again is not None and not again.chosen and again.race == cbuild.Race(0.002, 0.001)


def test_a_race_won_uses_the_kernel_and_a_race_that_raises_turns_it_off(fresh_gemv, monkeypatch, caplog):
    if shutil.which("cc") is None or gemv.kernel(gemm.pack) is None:
        pytest.skip(NO_KERNEL)
    for outcome, chosen in ((cbuild.Race(0.001, 0.002), True), (None, None)):
        gemv._once.reset()
        for f in fresh_gemv.glob("kernels/*.race.json"):
            f.unlink()

        def fake(k, pack, outcome=outcome):
            if outcome is None:
                raise RuntimeError("timer broke")
            return outcome

        monkeypatch.setattr(gemv, "race", fake)
        kernel = gemv.kernel(gemm.pack)
        if chosen is None:
            assert kernel is None and "decode gemv kernel not used: timing failed: RuntimeError: timer broke" in caplog.text
        else:
            assert kernel.chosen and _products_to_kernel(kernel, monkeypatch) == [1]


def test_the_whole_forward_is_raced_on_the_model(tmp_path, monkeypatch, caplog):
    """`LlamaModel.c_forward` under "auto": used only where the one call beat the layer-by-layer path on this
    model; a lost race leaves every decode step layer by layer (and "1" forces it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from triton_vlm.engine.model.model import LlamaModel

    torch.manual_seed(2)
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).eval().save_pretrained(tmp_path / "m")
    monkeypatch.setenv("TRITON_VLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_forward.ENV, "auto")
    monkeypatch.setattr(cbuild, "race", lambda *a, **kw: cbuild.Race(0.5, 0.25))  # before the load's first step
    caplog.set_level(logging.INFO)
    m = LlamaModel.from_pretrained(tmp_path / "m")
    if cpu_forward.Forward.for_model(m) is None:  # no compiler: nothing to race
        assert m.c_forward() is None
        pytest.skip(NO_KERNEL)
    assert m.c_forward() is None
    assert "C decode forward not used: slower than the layer-by-layer path here (500.000 ms vs layer by layer" in caplog.text
    monkeypatch.setenv(cpu_forward.ENV, "1")  # decided once per model: a model loaded with "1" takes it
    assert LlamaModel.from_pretrained(tmp_path / "m").c_forward() is not None
