"""`LLMService` without a server: stream diffing and the final-response rules, with fake senders and responses."""
from __future__ import annotations

import threading
import time

import pytest

from triton_vlm import names as N
from triton_vlm.errors import InvalidArgument, Unavailable
from triton_vlm.params import GenerationParams, GenerationRequest, GenerationResult, Sequence_
from triton_vlm.triton.llm import LLMService


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class FakeBackend:
    """Records submissions; the test plays the engine by calling the callback."""

    def __init__(self, refuse: Exception | None = None):
        self.refuse, self.submitted, self.cancelled = refuse, {}, []

    def start(self):
        pass

    def shutdown(self):
        pass

    def submit(self, gen, on_result):
        if self.refuse is not None:
            raise self.refuse
        self.submitted[gen.request_id] = on_result

    def cancel(self, request_id):
        self.cancelled.append(request_id)


class FakeSender:
    def __init__(self):
        self.sent, self.done = [], threading.Event()

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))
        if flags == 1:
            self.done.set()

    def is_cancelled(self):
        return False


class FakeRequest:
    def __init__(self):
        self.sender = FakeSender()

    def get_response_sender(self):
        return self.sender


def service(backend, gens):
    """A started service whose `parse` returns the next of `gens` (or raises it)."""
    svc = LLMService(backend, FakeTokenizer(), image_token_id=99, context_length=64,
                     make_response=lambda outputs: {k: v for k, (_, v) in outputs.items()},
                     make_error=lambda e: {"error": type(e).__name__, "message": str(e)})
    items = iter(gens)

    def parse(_request):
        g = next(items)
        if isinstance(g, Exception):
            raise g
        return g if isinstance(g, list) else [g]

    svc.parse = parse
    svc.start()
    return svc


def gen(rid="r0", stream=False, exclude=False, prompt=(1, 2, 99, 99, 3), **params):
    p = GenerationParams(max_tokens=8, stream=stream, exclude_input_in_output=exclude, pad_id=-1, **params)
    return GenerationRequest(request_id=rid, input_ids=list(prompt), params=p)


def run(svc, backend, results, request=None):
    request = request or FakeRequest()
    svc.execute([request])
    for res in results:
        backend.submitted[res.request_id](res)
    assert request.sender.done.wait(5), request.sender.sent
    svc.shutdown()
    return request.sender.sent


def test_non_streamed_final_holds_the_prompt_then_the_answer():
    backend = FakeBackend()
    svc = service(backend, [gen()])
    final = GenerationResult("r0", [Sequence_([7, 8], "<7><8>"), Sequence_([9], "<9>")], final=True)
    [(resp, flags)] = run(svc, backend, [final])
    assert flags == 1
    assert resp[N.TEXT_OUTPUT] == ["<1><2><image><3><7><8>", "<1><2><image><3><9>"]
    assert resp[N.OUTPUT_IDS].tolist() == [[1, 2, 99, 99, 3, 7, 8], [1, 2, 99, 99, 3, 9, -1]]
    assert resp[N.SEQUENCE_LENGTH] == [7, 6]


def test_streamed_pieces_and_final_concatenate_per_sequence_without_repeats():
    backend = FakeBackend()
    svc = service(backend, [gen(stream=True)])
    results = [GenerationResult("r0", [Sequence_([7], "<7>")], final=False, sequence_index=0),
               GenerationResult("r0", [Sequence_([5], "<5>")], final=False, sequence_index=1),
               GenerationResult("r0", [Sequence_([7, 8], "<7><8>"), Sequence_([5, 6, 4], "<5><6><4>")],
                                final=True)]
    sent = run(svc, backend, results)
    assert [flags for _, flags in sent] == [0, 0, 1]
    per_seq: dict[int, str] = {}
    for resp, _ in sent[:-1]:
        j = resp[N.SEQUENCE_INDEX][0]
        per_seq[j] = per_seq.get(j, "") + resp[N.TEXT_OUTPUT][0]
    final = sent[-1][0]
    for j, text in enumerate(final[N.TEXT_OUTPUT]):
        per_seq[j] = per_seq.get(j, "") + text
    assert per_seq == {0: "<7><8>", 1: "<5><6><4>"}  # never the prompt, nothing twice
    assert final[N.OUTPUT_IDS].tolist() == [[8, -1], [6, 4]]  # only the ids not streamed yet


def test_errors_refusals_and_bad_requests_each_get_one_final_error():
    backend = FakeBackend()
    svc = service(backend, [gen()])
    sent = run(svc, backend, [GenerationResult("r0", [], final=True, error=InvalidArgument("bad image count"))])
    assert sent == [({"error": "InvalidArgument", "message": "bad image count"}, 1)]

    refusing = FakeBackend(refuse=Unavailable("the request queue is full"))
    svc = service(refusing, [gen()])
    request = FakeRequest()
    svc.execute([request])
    assert request.sender.done.wait(5)
    svc.shutdown()
    assert request.sender.sent == [({"error": "Unavailable", "message": "the request queue is full"}, 1)]

    svc = service(FakeBackend(), [InvalidArgument("max_tokens is required")])
    request = FakeRequest()
    svc.execute([request])  # answered at once, on execute's own thread
    assert request.sender.sent == [({"error": "InvalidArgument", "message": "max_tokens is required"}, 1)]
    svc.shutdown()


def test_shutdown_answers_what_is_still_running():
    backend = FakeBackend()
    svc = service(backend, [gen(stream=True)])
    request = FakeRequest()
    svc.execute([request])
    backend.submitted["r0"](GenerationResult("r0", [Sequence_([7], "<7>")], final=False))
    time.sleep(0.05)
    svc.shutdown()  # the fake backend never finishes it
    assert [f for _, f in request.sender.sent] == [0, 1]
    assert request.sender.sent[-1][0]["error"] == "Unavailable"


def test_batched_rows_answer_with_their_batch_index_and_the_last_one_is_final():
    backend = FakeBackend()
    rows = [gen("r0/0", exclude=True), gen("r0/1", stream=True, prompt=(5, 6))]
    svc = service(backend, [rows])
    request = FakeRequest()
    svc.execute([request])
    assert set(backend.submitted) == {"r0/0", "r0/1"}
    backend.submitted["r0/1"](GenerationResult("r0/1", [Sequence_([4], "<4>")], final=False))
    backend.submitted["r0/1"](GenerationResult("r0/1", [Sequence_([4, 3], "<4><3>")], final=True))
    backend.submitted["r0/0"](GenerationResult("r0/0", [Sequence_([7], "<7>")], final=True))
    assert request.sender.done.wait(5)
    svc.shutdown()
    sent = request.sender.sent
    assert [(r[N.BATCH_INDEX], r[N.TEXT_OUTPUT], f) for r, f in sent] == [
        ([1], ["<4>"], 0), ([1], ["<3>"], 0), ([0], ["<7>"], 1)]


def test_a_failing_row_ends_the_request_naming_the_row_and_cancels_the_others():
    backend = FakeBackend()
    svc = service(backend, [[gen("r0/0"), gen("r0/1"), gen("r0/2")]])
    request = FakeRequest()
    svc.execute([request])
    backend.submitted["r0/0"](GenerationResult("r0/0", [Sequence_([7], "<7>")], final=True))
    backend.submitted["r0/1"](GenerationResult("r0/1", [], final=True, error=InvalidArgument("bad image count")))
    assert request.sender.done.wait(5)
    svc.shutdown()
    assert [f for _, f in request.sender.sent] == [0, 1]
    assert request.sender.sent[-1][0] == {"error": "InvalidArgument",
                                          "message": "row 1 of the batch: bad image count"}
    assert backend.cancelled == ["r0/2"]


def test_a_refused_row_refuses_the_request_and_cancels_the_rows_submitted():
    class RefuseSecond(FakeBackend):
        def submit(self, gen, on_result):
            if gen.request_id.endswith("/1"):
                raise Unavailable("the request queue is full")
            super().submit(gen, on_result)

    backend = RefuseSecond()
    svc = service(backend, [[gen("r0/0"), gen("r0/1")]])
    request = FakeRequest()
    svc.execute([request])
    assert request.sender.done.wait(5)
    svc.shutdown()
    assert request.sender.sent == [({"error": "Unavailable", "message": "row 1 of the batch: the request queue is "
                                                                        "full"}, 1)]
    assert backend.cancelled == ["r0/0"]


def test_cancelling_a_batched_request_cancels_every_row():
    backend = FakeBackend()
    svc = service(backend, [[gen("r0/0"), gen("r0/1")]])
    svc.execute([FakeRequest()])
    svc._cancel("r0")
    svc.shutdown()
    assert sorted(backend.cancelled) == ["r0/0", "r0/1"]


def test_token_counts_only_when_asked_and_per_response_when_streaming():
    backend = FakeBackend()
    svc = service(backend, [gen(stream=True, return_num_input_tokens=True, return_num_output_tokens=True)])
    sent = run(svc, backend, [GenerationResult("r0", [Sequence_([7, 8], "<7><8>")], final=False, cached_tokens=4),
                              GenerationResult("r0", [Sequence_([7, 8, 9], "<7><8><9>")], final=True,
                                               cached_tokens=4)])
    assert [(r[N.NUM_INPUT_TOKENS], r[N.NUM_OUTPUT_TOKENS]) for r, _ in sent] == [([5], [2]), ([5], [1])]
    assert [r[N.NUM_CACHED_TOKENS] for r, _ in sent] == [[4], [4]]  # the prefix cache's share, with the input count
    backend = FakeBackend()
    svc = service(backend, [gen(return_num_output_tokens=True)])
    [(resp, _)] = run(svc, backend, [GenerationResult("r0", [Sequence_([7, 8], "<7><8>"), Sequence_([9], "<9>")],
                                                      final=True)])
    assert resp[N.NUM_OUTPUT_TOKENS] == [3] and N.NUM_INPUT_TOKENS not in resp and N.NUM_CACHED_TOKENS not in resp
    backend = FakeBackend()
    svc = service(backend, [gen()])
    [(resp, _)] = run(svc, backend, [GenerationResult("r0", [Sequence_([7], "<7>")], final=True)])
    assert N.NUM_INPUT_TOKENS not in resp and N.NUM_OUTPUT_TOKENS not in resp


def test_own_copies_do_not_share_memory_with_the_input():
    import torch

    from triton_vlm.triton.llm import own_copies

    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    a, none = own_copies([x[0], None])
    x.zero_()  # the input buffer is reused after execute() returns
    assert none is None and a.sum().item() == sum(range(12))


@pytest.mark.gpu
def test_own_copies_on_cuda_are_complete_when_they_return():
    """Complete when it returns (the buffer is then rewritten from another stream, as Triton reuses it), without
    waiting for the work queued on the default stream (the engine's forward passes)."""
    import torch

    from triton_vlm.triton.llm import own_copies

    dev = torch.device("cuda")
    src = torch.randn(4, 576, 4096, device=dev)
    want = src.clone()
    big = torch.randn(8192, 8192, device=dev)
    torch.cuda.synchronize()
    for _ in range(40):  # a long tail of work on the default stream
        big = big @ big
        big /= big.norm()
    [copy] = own_copies([src])
    assert not torch.cuda.default_stream(dev).query(), "own_copies waited for the default stream"
    other = torch.cuda.Stream(dev)
    with torch.cuda.stream(other):
        src.fill_(float("nan"))
    torch.cuda.synchronize()
    assert torch.equal(copy, want)


def test_top_log_probs_only_when_asked_padded_and_not_repeated_after_streaming():
    backend = FakeBackend()
    svc = service(backend, [gen(top_log_probs=2)])
    a = Sequence_([7, 8], "<7><8>", -1.0, [-0.5, -0.5], [[-0.5, -1.0], [-0.5, -2.0]], [[7, 3], [8, 4]])
    b = Sequence_([9], "<9>", -0.125, [-0.125], [[-0.125, -3.0]], [[9, 5]])
    [(resp, _)] = run(svc, backend, [GenerationResult("r0", [a, b], final=True)])
    assert resp[N.OUTPUT_TOP_LOG_PROB_IDS].tolist() == [[[7, 3], [8, 4]], [[9, 5], [-1, -1]]]
    assert resp[N.OUTPUT_TOP_LOG_PROBS].tolist() == [[[-0.5, -1.0], [-0.5, -2.0]], [[-0.125, -3.0], [0.0, 0.0]]]
    backend = FakeBackend()
    svc = service(backend, [gen(stream=True, top_log_probs=2)])
    piece = Sequence_([7], "<7>", 0.0, [-0.5], [[-0.5, -1.0]], [[7, 3]])
    sent = run(svc, backend, [GenerationResult("r0", [piece], final=False), GenerationResult("r0", [a], final=True)])
    assert [r[N.OUTPUT_TOP_LOG_PROB_IDS].tolist() for r, _ in sent] == [[[[7, 3]]], [[[8, 4]]]]
    backend = FakeBackend()
    svc = service(backend, [gen()])
    [(resp, _)] = run(svc, backend, [GenerationResult("r0", [a], final=True)])
    assert N.OUTPUT_TOP_LOG_PROBS not in resp and N.OUTPUT_TOP_LOG_PROB_IDS not in resp


def test_a_stop_request_cancels_the_running_request_of_its_triton_id():
    """tensorrt_llm's `stop` reaches the engine: a request to llm with `stop` true and a running request's Triton
    request id cancels that request's rows; the stop request gets an empty final response."""
    from triton_vlm.errors import Cancelled
    from triton_vlm.triton.llm import _StopAsked

    backend = FakeBackend()
    svc = service(backend, [gen("r0"), _StopAsked("llmapi-7"), _StopAsked("other")])

    class Named(FakeRequest):
        def request_id(self):
            return "llmapi-7"

    running, stop, unknown = Named(), FakeRequest(), FakeRequest()
    svc.execute([running])
    svc.execute([stop])
    assert backend.cancelled == ["r0"] and stop.sender.sent == [({}, 1)]
    svc.execute([unknown])  # an id that names no running request: nothing else cancelled
    assert backend.cancelled == ["r0"] and unknown.sender.sent == [({}, 1)]
    backend.submitted["r0"](GenerationResult("r0", [], final=True, error=Cancelled("cancelled")))
    assert running.sender.done.wait(5)
    assert svc._by_triton_id == {}  # forgotten once it ended
    svc.shutdown()
