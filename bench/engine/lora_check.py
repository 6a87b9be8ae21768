"""What checking wire LoRA tensors costs preprocess: memory and time of `check_request` (in place, what
preprocess runs) against `parse_request` (the same checks, then the adapter built, what llm runs and what
preprocess ran before).

    python -m bench.engine.lora_check               # a rank-16 adapter on every projection of a 7B Llama's 32 layers

The weights are FP16 [224, 241664] (103 MiB) and read-only, as Triton hands them over. Memory: numpy's peak
allocation during the call (`tracemalloc`), plus the bytes of the torch tensors built (the adapter).
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np
import torch

from triton_vlm.lora.format import MODULE_IDS, module_shape
from triton_vlm.lora.registry import Registry
from triton_vlm.lora.request import check_request, parse_request
from triton_vlm.spec import TextSpec

LLAMA_7B = TextSpec(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                    num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=4096)


def wire_tensors(spec: TextSpec, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rows, config = [], []
    for layer in range(spec.num_layers):
        for module, mid in MODULE_IDS.items():
            n_in, n_out = module_shape(spec, module)
            rows.append(np.full(rank * (n_in + n_out), 0.001, np.float16))
            config.append([mid, layer, rank])
    width = max(len(r) for r in rows)
    weights = np.stack([np.pad(r, (0, width - len(r))) for r in rows])
    weights.flags.writeable = False
    return weights, np.array(config, np.int32)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.engine.lora_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = LLAMA_7B
    weights, config = wire_tensors(spec, args.rank)
    registry = Registry(None, spec)
    print(f"lora_weights {list(weights.shape)} {weights.dtype}: {weights.nbytes / 2**20:.1f} MiB")
    for label, fn in (("check_request (preprocess)", check_request), ("parse_request (llm)", parse_request)):
        tracemalloc.start()
        t = time.perf_counter()
        out = fn(5, weights, config, None, spec, registry, 64)
        dt = time.perf_counter() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        built = out.wire.nbytes if out is not None else 0
        print(f"{label:28s} numpy peak {peak / 2**20:7.2f} MiB, tensors built {built / 2**20:6.1f} MiB, "
              f"{dt * 1000:6.0f} ms")


if __name__ == "__main__":
    main()
