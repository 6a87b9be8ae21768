"""Command line of the vision encoder's artifacts.

    python -m triton_vlm.vision export MODEL_DIR OUT.onnx [--dtype float32|float16]
    python -m triton_vlm.vision build-trt ONNX OUT.plan --max-batch N      (a GPU machine with TensorRT)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m triton_vlm.vision", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="the tower (up to the feature layer) + select + projector as one ONNX file")
    ex.add_argument("model_dir", type=Path)
    ex.add_argument("out", type=Path)
    ex.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                    help="float16: the graph TensorRT builds strongly typed (LayerNorm and softmax in fp32)")
    bt = sub.add_parser("build-trt", help="a TensorRT plan from an fp16 ONNX file (one batch profile)")
    bt.add_argument("onnx", type=Path)
    bt.add_argument("out", type=Path)
    bt.add_argument("--max-batch", type=int, required=True, help="the profile's max batch (min 1, opt N/2)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "export":
            from .export import export_onnx  # noqa: PLC0415

            print(export_onnx(args.model_dir, args.out, args.dtype))
        else:
            from .trt import build_plan  # noqa: PLC0415

            print(build_plan(args.onnx, args.out, args.max_batch))
    except ImportError as e:
        print(f"error: {e} (build-trt needs TensorRT's Python package, on a GPU machine)", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
