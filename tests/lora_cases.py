"""Bad TensorRT-LLM LoRA tensors, one of each kind, with the message each must be refused with: shared by the
unit test of the checks (`test_lora.py`) and the live server's (`test_server_lora.py`)."""
from __future__ import annotations

import numpy as np


def bad_wire(weights: np.ndarray, config: np.ndarray, num_layers: int, max_rank: int = 64) -> list:
    """(name, lora kwargs (task_id / weights / config), message) for every kind of bad wire tensors, built from a
    good pair (at least three rows) of a model with `num_layers` layers."""
    def cfg(row, col, value):
        c = config.copy()
        c[row, col] = value
        return c

    nan = weights.copy()
    nan[1, 0] = np.nan
    return [
        ("layer", dict(task_id=78, weights=weights, config=cfg(0, 1, 99)),
         f"lora_config row 0: Expected layerId to be in the range [0, {num_layers}), got 99"),
        ("module", dict(task_id=78, weights=weights, config=cfg(2, 0, 12)),
         "lora_config row 2: lora module 12 not enabled for this model"),
        ("rank", dict(task_id=78, weights=weights, config=cfg(0, 2, max_rank + 1)),
         f"Invalid low_rank (r) {max_rank + 1}; must be in [1, {max_rank}] (max_lora_rank)"),
        ("rank0", dict(task_id=78, weights=weights, config=cfg(0, 2, 0)), "Invalid low_rank (r) 0"),
        ("short", dict(task_id=78, weights=weights[:, :10], config=config), "lora_weights row 0 has to few values"),
        ("rows", dict(task_id=78, weights=weights[:-1], config=config),
         "Expected dim1 lora_weights and lora_config to have the same size"),
        ("nan", dict(task_id=78, weights=nan, config=config), "lora_weights holds NaN or infinite values"),
        ("no id", dict(weights=weights, config=config), "need a lora_task_id"),
        ("weights only", dict(task_id=78, weights=weights), "must be sent together (got only lora_weights)"),
        ("config only", dict(task_id=78, config=config), "must be sent together (got only lora_config)"),
    ]


def preprocess_error(grpc_url: str, prompt: str, **lora) -> tuple[str | None, str | None]:
    """Sends the LoRA inputs (task_id / weights / config) straight to the preprocess model with stock
    tritonclient's unary gRPC call (a stream's error carries no status code; preprocess is not decoupled):
    -> (status, message) of its error, (None, None) when it accepted them."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    arrays = {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": np.array([[8]], np.int32)}
    if "task_id" in lora:
        arrays["lora_task_id"] = np.array([[lora["task_id"]]], np.uint64)
    if "weights" in lora:
        arrays["lora_weights"] = lora["weights"][None].astype(np.float16)  # [1, N, W]
        arrays["lora_config"] = lora["config"][None].astype(np.int32)  # [1, N, 3]
    inputs = []
    for name, arr in arrays.items():
        x = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        x.set_data_from_numpy(arr)
        inputs.append(x)
    with grpcclient.InferenceServerClient(grpc_url) as client:
        try:
            client.infer("preprocess", inputs, client_timeout=60)
        except InferenceServerException as e:
            return e.status(), e.message()
    return None, None
