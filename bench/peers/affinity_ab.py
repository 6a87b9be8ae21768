"""Ours at one concurrency, on one server, alternating between no CPU affinity and vLLM's layout (the llm stub
alone on the first CPU, every other process of ours and the client on the rest; `bench.peers.side_by_side --pin-llm`):

    python -m bench.peers.affinity_ab                       # concurrency 16, 3 rounds of each, vllm bench serve as client

Alternating on one server keeps a shared machine's drift out of the difference (a full `bench.peers.side_by_side` run per
layout does not). Prints one line per run and the means; writes `bench/results/peer_ab.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.peers import side_by_side as peer, procs as peer_procs, vllm_env as peer_vllm


def layout(root: int, pinned: bool) -> None:
    if pinned:
        peer.pin_llm(root)
        return
    everything = set(peer.ALL_CPUS)
    peer_procs.apply_affinity({u.pid: everything for u in peer_procs.snapshot(root).values()})
    os.sched_setaffinity(0, everything)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--prompts-factor", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=peer.RESULTS_DIR)
    args = ap.parse_args(argv)
    from bench.common.model import ensure_bench_model  # noqa: PLC0415

    py = peer_vllm.ensure_venv()
    hub = peer_vllm.ensure_hub_model(ensure_bench_model())
    work = Path(tempfile.mkdtemp(prefix="triton-vlm-peer-ab-"))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    ports = {k: peer.free_port() for k in ("http", "grpc", "metrics", "openai")}
    log, url = work / "ours-server.log", f"http://127.0.0.1:{ports['openai']}"
    metrics = (f"http://127.0.0.1:{ports['metrics']}/metrics", f"{url}/metrics")
    proc = peer.start(peer.ours_command(hub, ports), log, env)
    runs: dict[bool, list[peer.Point]] = {False: [], True: []}
    try:
        peer.wait_ready(proc, url, log, args.timeout, "triton-vlm: serving")
        for r in range(1, args.rounds + 1):
            for pinned in (False, True):
                layout(proc.pid, pinned)
                runs[pinned].append(peer.drive("ours-pinned" if pinned else "ours", r, args.concurrency, args, py,
                                               hub, (proc.pid, url, metrics), work, env))
    finally:
        os.sched_setaffinity(0, set(peer.ALL_CPUS))
        peer.stop(proc)
    means = {k: statistics.fmean(p.output_tok_s for p in v) for k, v in runs.items()}
    print(f"concurrency {args.concurrency}: unpinned {means[False]:.1f} tok/s, pinned {means[True]:.1f} tok/s "
          f"({means[True] / means[False]:.2f}x; {args.rounds} alternating rounds on one server)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer_ab.json").write_text(json.dumps(
        {"concurrency": args.concurrency, "means": {"unpinned": means[False], "pinned": means[True]},
         "runs": {k: [asdict(p) for p in v] for k, v in (("unpinned", runs[False]), ("pinned", runs[True]))}},
        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
