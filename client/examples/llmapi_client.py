#!/usr/bin/env python
"""A client for TensorRT-LLM's `llmapi` Triton model (`tensorrt_llm`), in the shape of TensorRT-LLM's own
`llmapi_client.py`: stock `tritonclient` only, its flags, its output lines. The model is decoupled, so requests go
over a gRPC stream; `--streaming` asks for the text piece by piece, `--stop-after-ms` sends TensorRT-LLM's stop
request (`stop` true under the same request id) or, with `--stop-via-request-cancel`, closes the stream.

    python client/examples/llmapi_client.py -u localhost:8001 --text "USER: <image>\\nWhat is it? ASSISTANT:" \\
        --image-url https://example.com/cat.png --request-output-len 32 --streaming
"""
import argparse
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype


def tensor(name, array):
    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def request_inputs(flags):
    inputs = [tensor("text_input", np.array([flags.text.encode()], dtype=object)),
              tensor("sampling_param_max_tokens", np.array([flags.request_output_len], dtype=np.int32)),
              tensor("sampling_param_exclude_input_from_output", np.array([True])),
              tensor("streaming", np.array([flags.streaming])),
              tensor("return_finish_reason", np.array([True]))]
    if flags.image_url:
        inputs.append(tensor("image_url", np.array([u.encode() for u in flags.image_url], dtype=object)))
    if flags.return_perf_metrics:
        inputs.append(tensor("sampling_param_return_perf_metrics", np.array([True])))
    return inputs


def stop_inputs():
    return [tensor("text_input", np.array([b""], dtype=object)), tensor("stop", np.array([True]))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-u", "--url", default="localhost:8001", help="Triton's gRPC address")
    p.add_argument("--text", default="USER: Describe a red circle. ASSISTANT:", help="the prompt")
    p.add_argument("--image-url", action="append", default=[], help="an image (data: or http(s) URL); repeatable")
    p.add_argument("-S", "--streaming", action="store_true", help="stream the text")
    p.add_argument("--request-output-len", type=int, default=16, help="sampling_param_max_tokens")
    p.add_argument("--stop-after-ms", type=int, default=0, help="stop the generation after this many ms")
    p.add_argument("--stop-via-request-cancel", action="store_true", help="stop by closing the stream")
    p.add_argument("--request-id", default="1")
    p.add_argument("--return-perf-metrics", action="store_true", help="print the per-request perf outputs")
    p.add_argument("--model-name", default="tensorrt_llm")
    p.add_argument("-t", "--stream-timeout", type=float, default=120.0)
    flags = p.parse_args()

    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(url=flags.url)
    client.start_stream(callback=lambda result, error: responses.put(error if error else result))
    client.async_stream_infer(flags.model_name, request_inputs(flags), request_id=flags.request_id,
                              enable_empty_final_response=True)
    if flags.stop_after_ms > 0:
        time.sleep(flags.stop_after_ms / 1000.0)
        if flags.stop_via_request_cancel:
            client.stop_stream(cancel_requests=True)
        else:
            client.async_stream_infer(flags.model_name, stop_inputs(), request_id=flags.request_id)
    text, last = [], None
    try:
        while True:
            result = responses.get(timeout=flags.stream_timeout)
            if isinstance(result, InferenceServerException):
                if "CANCELLED" in str(result.status()):
                    print("Request is cancelled")
                    if flags.stop_after_ms > 0 and not flags.stop_via_request_cancel:
                        continue  # the stop request's own answer; the running one still ends
                    break
                sys.exit(f"Received an error from server: {result}")
            response = result.get_response()
            if response.outputs:
                text.append(result.as_numpy("text_output")[0].decode("utf-8"))
                last = result
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    print(f"Output text: {''.join(text)}")
    if last is not None:
        print(f"finish_reason: {last.as_numpy('finish_reason')[0].decode()}")
        if flags.return_perf_metrics:
            for name in ("kv_cache_reused_block", "kv_cache_hit_rate", "arrival_time_ns", "first_token_time_ns",
                         "last_token_time_ns"):
                print(f"{name}: {last.as_numpy(name)[0]}")


if __name__ == "__main__":
    main()
