"""Faults inside the engine end the request concerned only, give back everything it held, and never wedge the
loop: admission failures (a failed device copy of an adapter, a faulty KV cache), rows with nothing left to
choose (every token excluded, NaN logits), a step that raises (backoff), and CUDA errors (on_fatal)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from triton_vlm.demo.checkpoint import build_random_llava_objects, save_checkpoint
from triton_vlm.engine.engine import Engine, EngineConfig
from triton_vlm.engine.model.faults import Backoff, as_error, is_device_fault
from triton_vlm.errors import Internal, InvalidArgument, Unavailable
from triton_vlm.lora.format import Adapter, LoraModule, module_shape
from triton_vlm.params import GenerationParams, GenerationRequest


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    torch.set_num_threads(1)
    model, processor = build_random_llava_objects(seed=5, max_position_embeddings=96)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return save_checkpoint(model, processor, tmp_path_factory.mktemp("llava"))


def engine(path, **kw) -> Engine:
    return Engine(path, EngineConfig(**(dict(max_rows=32, kv_cache_tokens=2048, block_size=4, prefill_chunk=8) | kw)))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(5, 300, (n - 1,), generator=g).tolist()


def request(rid, ids, max_tokens=8, adapter=None, bad_words=(), **kw) -> GenerationRequest:
    return GenerationRequest(rid, list(ids), GenerationParams(max_tokens=max_tokens, **kw), adapter=adapter,
                             bad_words_ids=[list(w) for w in bad_words])


def tiny_adapter(name: str, spec, seed: int, cls=Adapter) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    n_in, n_out = module_shape(spec, "q_proj")
    return cls(name, {(0, "q_proj"): LoraModule(torch.randn(2, n_in, generator=g) * 0.1,
                                                torch.randn(n_out, 2, generator=g) * 0.1, 1.0)})


class CopyFails(Adapter):
    """An adapter whose copy to the device fails, as a CUDA out-of-memory error or a bad tensor would."""

    error: BaseException = RuntimeError("bad tensor")

    def to(self, device):
        raise self.error


def run(eng: Engine, reqs: list[GenerationRequest]) -> dict[str, list]:
    results = {r.request_id: [] for r in reqs}
    for r in reqs:
        eng.submit(r, lambda res: results[res.request_id].append(res))
    for _ in range(500):
        if not eng.step():
            break
    assert all(v and v[-1].final for v in results.values())
    return results


def tokens(results) -> list[list[int]]:
    last = results[-1]
    assert last.final and last.error is None, last.error
    return [s.token_ids for s in last.sequences]


def held(eng: Engine) -> dict[str, int]:
    """Every budget the engine hands out; all 0 when nothing runs."""
    return dict(kv_reserved=eng.cache.reserved, kv_used=eng.cache.used_blocks,
                rows_reserved=eng.scheduler.rows_reserved,
                adapter_refs=sum(s.refs for s in eng.lora_slots._slots.values()),
                queued=len(eng.scheduler.waiting), running=len(eng.scheduler.running))


IDLE = dict(kv_reserved=0, kv_used=0, rows_reserved=0, adapter_refs=0, queued=0, running=0)


def fail_call(obj, name: str, at: set[int], error: BaseException):
    """Make `obj.name` raise `error` on the calls numbered in `at` (0 = the first call from now)."""
    real, calls = getattr(obj, name), [0]

    def faulty(*args, **kwargs):
        n, calls[0] = calls[0], calls[0] + 1
        if n in at:
            raise error
        return real(*args, **kwargs)

    setattr(obj, name, faulty)


@pytest.mark.parametrize("fault", ["adapter-copy-oom", "adapter-copy-bad-tensor", "kv-new-row", "kv-reserve"])
def test_admission_failure_rolls_back_and_fails_only_that_request(path, fault):
    """The failing request is admitted between two others in one step; it ends alone with its error, every
    reservation it took is given back (repeated more often than the cache could hold if one leaked), and the
    other requests, with and without adapters, get the tokens they get alone."""
    eng = engine(path, kv_cache_tokens=160)  # 40 blocks
    spec = eng.model_config
    good = tiny_adapter("good", spec, 1)
    if fault.startswith("adapter"):
        bad = tiny_adapter("bad", spec, 2, cls=CopyFails)
        object.__setattr__(bad, "error", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
                           if fault.endswith("oom") else RuntimeError("bad tensor"))  # a frozen dataclass
    else:
        bad = tiny_adapter("bad", spec, 2)
    others = [request("a", prompt(6, 1), beam_width=2), request("b", prompt(9, 2), adapter=good),
              request("c", prompt(5, 3), max_tokens=6)]
    alone = {r.request_id: tokens(run(eng, [r])[r.request_id]) for r in others}
    assert held(eng) == IDLE
    need = eng.validate(request("x", prompt(8, 9), max_tokens=24, beam_width=3))
    rounds = eng.cache.num_blocks // need + 2  # a leaked reservation per round would starve the last rounds
    for i in range(rounds):
        failing = request(f"bad{i}", prompt(8, 9), max_tokens=24, beam_width=3, adapter=bad)
        if fault == "kv-new-row":  # admission order: a, failing, b, c
            fail_call(eng.cache, "new_row", {1}, RuntimeError("KV cache fault"))
        elif fault == "kv-reserve":
            fail_call(eng.cache, "try_reserve", {1}, RuntimeError("KV cache fault"))
        out = run(eng, [others[0], failing, *others[1:]])
        vars(eng.cache).pop("new_row", None), vars(eng.cache).pop("try_reserve", None)
        got = out[failing.request_id]
        assert len(got) == 1 and got[0].final and got[0].sequences == []
        err = got[0].error
        if fault == "adapter-copy-oom":
            assert isinstance(err, Unavailable) and "out of device memory while admitting" in err.message
        else:
            assert isinstance(err, Internal) and f"while admitting request {failing.request_id}" in err.message
            assert ("bad tensor" if fault == "adapter-copy-bad-tensor" else "KV cache fault") in err.message
        for r in others:
            assert tokens(out[r.request_id]) == alone[r.request_id], (i, r.request_id)
        assert held(eng) == IDLE, i
    assert eng.scheduler.fault is None  # out of memory is not a CUDA fault: the engine goes on


def test_a_failing_step_backs_off_then_recovers(path):
    """A step that raises (not a request's failure) is retried after a pause that doubles, not at once; the
    first success resets it and the request waiting meanwhile is served."""
    eng = engine(path)
    calls: list[float] = []
    real = eng.scheduler.step

    def flaky(*args):
        calls.append(time.monotonic())
        if len(calls) <= 5:
            raise RuntimeError("scheduler bug")
        return real(*args)

    eng.scheduler.step = flaky
    done, got = threading.Event(), []
    eng.start()
    try:
        eng.submit(request("r", prompt(6, 4)), lambda res: (got.append(res), res.final and done.set()))
        assert done.wait(20), "the request was served once the step stopped failing"
    finally:
        eng.shutdown()
    gaps = [b - a for a, b in zip(calls, calls[1:6])]
    expected = [Backoff().first * 2 ** i for i in range(5)]  # 0.01, 0.02, 0.04, 0.08, 0.16 s
    assert all(g >= 0.9 * e for g, e in zip(gaps, expected)), (gaps, expected)
    assert got[-1].error is None and eng.backoff.failures == 0


def test_backoff_is_bounded_and_resets():
    b = Backoff(first=0.01, cap=0.5)
    assert b.delay == 0.0
    assert [b.failed() for _ in range(8)] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]
    for _ in range(5000):
        b.failed()
    assert b.delay == 0.5
    b.reset()
    assert b.delay == 0.0


MODES = {"greedy": {}, "sampling": dict(do_sample=True, temperature=1.3, seed=3, num_return_sequences=2),
         "beam": dict(beam_width=3), "beam-sampling": dict(beam_width=2, do_sample=True, seed=5)}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_token_excluded_fails_that_request_only(path, mode):
    """Bad words covering the vocabulary (the end id is never a bad word) and min_tokens exclude every token at
    the first step: that request ends with INVALID_ARG naming both; the others in its batch are unaffected."""
    eng = engine(path)
    vocab = eng.model_config.vocab_size
    others = [request("g", prompt(7, 5)), request("s", prompt(5, 6), max_tokens=6, **MODES[mode]),
              request("b", prompt(8, 7), beam_width=2)]
    alone = {r.request_id: tokens(run(eng, [r])[r.request_id]) for r in others}
    stuck = request("stuck", prompt(6, 8), min_tokens=3, bad_words=[[t] for t in range(vocab)], **MODES[mode])
    out = run(eng, [others[0], stuck, *others[1:]])
    err = out["stuck"][-1].error
    assert len(out["stuck"]) == 1 and isinstance(err, InvalidArgument), err
    assert "every token is excluded at generated token 1 by bad_words" in err.message
    assert f"({vocab} words)" in err.message and "min_tokens (3" in err.message
    for r in others:
        assert tokens(out[r.request_id]) == alone[r.request_id], r.request_id
    assert held(eng) == IDLE


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_logits_fail_that_request_only(path, mode):
    """A model that gives one request NaN logits (an fp16 overflow) at its third token: that request ends with
    an error naming non-finite logits (never a sampling kernel's complaint), the others are unaffected."""
    eng = engine(path)
    others = [request("g", prompt(7, 5)), request("s", prompt(5, 6), max_tokens=6, **MODES[mode])]
    alone = {r.request_id: tokens(run(eng, [r])[r.request_id]) for r in others}
    real = eng.scheduler.runner.decode

    def decode(actives):
        logits, start = real(actives).clone(), 0  # [rows, vocab]
        for a in actives:
            n = len(a.kv.rows)
            if a.id == "nan" and a.timing.steps == 2:
                logits[start:start + n] = torch.tensor(float("nan")).half()
            start += n
        return logits

    eng.scheduler.runner.decode = decode
    out = run(eng, [others[0], request("nan", prompt(6, 8), max_tokens=10, **MODES[mode]), others[1]])
    err = out["nan"][-1].error
    assert isinstance(err, Internal) and "non-finite logits (NaN or inf) at generated token 3" in err.message, err
    for r in others:
        assert tokens(out[r.request_id]) == alone[r.request_id], r.request_id
    assert held(eng) == IDLE and eng.scheduler.fault is None


class FakeCudaError(RuntimeError):
    """What PyTorch raises once a kernel failed on the device (the message is PyTorch's)."""


def test_cuda_error_stops_the_engine_and_calls_on_fatal(path):
    """A CUDA error from the model: the engine stops (the device context may be unusable), every request it holds
    gets a final error, later submits are refused, and on_fatal gets the error once."""
    eng = engine(path)
    boom = FakeCudaError("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
                         "reported at some other API call")
    real, armed = eng.model.forward, threading.Event()

    def forward(*args, **kwargs):
        if armed.is_set():
            raise boom
        return real(*args, **kwargs)

    eng.model.forward = forward
    fatal: list[BaseException] = []
    stopped = threading.Event()
    eng.on_fatal = lambda e: (fatal.append(e), stopped.set())
    results: dict[str, list] = {"running": [], "queued": []}
    first = threading.Event()
    eng.submit(request("running", prompt(6, 1), max_tokens=40, min_tokens=40, stream=True),
               lambda r: (results["running"].append(r), first.set()))
    eng.start()
    try:
        assert first.wait(20)
        eng.submit(request("queued", prompt(80, 2), max_tokens=8), results["queued"].append)
        armed.set()
        assert stopped.wait(20), "on_fatal was called"
        eng._thread.join(5)
        assert not eng._thread.is_alive(), "the loop ended"
    finally:
        eng.shutdown()
    assert fatal == [boom]
    for rid in ("running", "queued"):
        last = results[rid][-1]
        assert last.final and isinstance(last.error, (Internal, Unavailable)), (rid, last.error)
    assert "CUDA error" in results["queued"][-1].error.message
    with pytest.raises(Unavailable):
        eng.submit(request("after", prompt(5, 3)), print)


def test_what_counts_as_a_device_fault():
    assert is_device_fault(FakeCudaError("CUDA error: an illegal memory access was encountered"))
    assert is_device_fault(RuntimeError("...: device-side assert triggered"))
    assert is_device_fault(torch.AcceleratorError("anything"))
    chained = ValueError("while decoding")
    chained.__cause__ = RuntimeError("CUDA error: misaligned address")
    assert is_device_fault(chained)
    assert not is_device_fault(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert not is_device_fault(RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"))
    assert isinstance(as_error(torch.OutOfMemoryError("CUDA out of memory")), Unavailable)
    assert isinstance(as_error(KeyError("x")), Internal)
    e = InvalidArgument("kept")
    assert as_error(e) is e


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sampling", "beam-sampling"])
def test_on_cuda_no_token_left_leaves_the_device_usable(path, mode):
    """On CUDA an invalid distribution in `multinomial` is a device-side assert that ends every later kernel;
    the excluded vocabulary and NaN logits end their requests, and the device still serves the next ones."""
    eng = engine(path, device="cuda")
    vocab = eng.model_config.vocab_size
    real = eng.scheduler.runner.decode

    def decode(actives):
        logits, start = real(actives).clone(), 0  # [rows, vocab]
        for a in actives:
            if a.id == "nan":
                logits[start:start + len(a.kv.rows)] = float("nan")
            start += len(a.kv.rows)
        return logits

    eng.scheduler.runner.decode = decode
    out = run(eng, [request("stuck", prompt(6, 8), min_tokens=3, bad_words=[[t] for t in range(vocab)],
                            **MODES[mode]),
                    request("nan", prompt(6, 9), **MODES[mode]), request("ok", prompt(7, 5), **MODES[mode])])
    assert isinstance(out["stuck"][-1].error, InvalidArgument)
    assert isinstance(out["nan"][-1].error, Internal) and "non-finite logits" in out["nan"][-1].error.message
    torch.cuda.synchronize()  # raises if a kernel asserted
    assert tokens(out["ok"]) and tokens(run(eng, [request("later", prompt(5, 3), **MODES[mode])])["later"])
    assert held(eng) == IDLE and eng.scheduler.fault is None
