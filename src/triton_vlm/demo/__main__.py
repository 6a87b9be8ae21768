"""`python -m triton_vlm.demo [--out DIR] [--force]`: build (or show) the trained demo model; without --out, also
its LoRA adapters and its copy in the hub's layout (llava-hf's transformers-4 keys, two shards and an index)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from triton_vlm.demo.build import DEMO_VERSION, build_demo_model, demo_model_path, is_complete, read_info

    ap = argparse.ArgumentParser(prog="python -m triton_vlm.demo", description=__doc__)
    ap.add_argument("--out", type=Path, default=None,
                    help=f"model directory (default: $TRITON_VLM_CACHE or ~/.cache/triton_vlm, then /{DEMO_VERSION})")
    ap.add_argument("--force", action="store_true", help="rebuild even if the model already exists")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    out = (args.out or demo_model_path()).expanduser().resolve()
    if is_complete(out) and not args.force:
        print(f"demo model already built at {out} (use --force to rebuild)", file=sys.stderr)
    else:
        build_demo_model(out, force=args.force, progress=not args.quiet)
    info = read_info(out)
    print(json.dumps({k: v for k, v in info.items() if k != "recipe"}, indent=2))
    print(out)
    if args.out is None:  # the LoRA adapters of the cached demo model, and its copy in the hub's layout
        from triton_vlm.demo import ensure_demo_adapters, ensure_demo_hub_model  # noqa: PLC0415

        print(ensure_demo_adapters(progress=not args.quiet))
        print(ensure_demo_hub_model(progress=not args.quiet))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
