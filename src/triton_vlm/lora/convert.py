"""`python -m triton_vlm.lora.convert -i PEFT_DIR -o OUT_DIR [--dtype float16|float32] [--model CHECKPOINT]`

Writes TensorRT-LLM's `model.lora_weights.npy` ([N, W]: A then scale * B per row, zero padded) and
`model.lora_config.npy` ([N, 3]: module id, layer, rank) from a PEFT adapter, as TensorRT-LLM's
`hf_lora_convert.py` does, with PEFT's own rules where that converter departs from them (`alpha_pattern` honoured;
vision-tower, DoRA, bias and `modules_to_save` adapters refused). `--model` checks shapes and layers against
the base checkpoint. The output folder is a registry entry (`--lora-dir`) as it is.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ..errors import InvalidArgument
from .peft import peft_to_trtllm

DTYPES = {"float16": np.float16, "float32": np.float32}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m triton_vlm.lora.convert", description=__doc__.split("\n\n")[1])
    ap.add_argument("-i", "--in-dir", required=True, type=Path, help="PEFT adapter folder")
    ap.add_argument("-o", "--out-dir", required=True, type=Path, help="where the .npy pair is written")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="storage type of lora_weights")
    ap.add_argument("--model", type=Path, help="base checkpoint to check the adapter against (optional)")
    args = ap.parse_args(argv)
    spec = None
    if args.model is not None:
        from ..spec import CheckpointSpec  # noqa: PLC0415

        spec = CheckpointSpec.load(args.model).text
    try:
        weights, config = peft_to_trtllm(args.in_dir, spec, DTYPES[args.dtype])
    except InvalidArgument as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    np.save(args.out_dir / "model.lora_weights.npy", weights)
    np.save(args.out_dir / "model.lora_config.npy", config)
    print(f"wrote {args.out_dir}: lora_weights {list(weights.shape)} {weights.dtype}, lora_config "
          f"{list(config.shape)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
