"""Benchmark rows -> console table, markdown report and PNG plot.

A row is one (backend, beam_width, concurrency) measurement (`RowResult`). The report pairs each engine row
with the baseline ("hf") row of the same beam width and concurrency and shows the ratio ours/baseline of
tokens per second (higher is better) and of p50 latency (lower is better). `stream_lines` renders the one-stream
measurement against the memory bandwidth (`bench/common/bandwidth.py`), `target_lines` the issue's targets read off
the same run, and the markdown starts with the command that produced it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from bench.common import machine

OURS, BASELINE = "engine", "hf"
LABELS = {OURS: "engine (in-flight batching)", BASELINE: "hf generate() baseline"}


@dataclass
class RowResult:
    backend: str
    beam_width: int
    concurrency: int
    requests: int  # completed without error
    errors: int
    tokens: int  # generated tokens of the best sequence, summed over completed requests
    seconds: float  # wall time from the first request sent to the last response received
    tokens_per_s: float
    requests_per_s: float
    p50_s: float  # latency percentiles of completed requests (numpy linear interpolation)
    p99_s: float
    mean_s: float
    tokens_per_request: float
    first_error: str = ""
    latencies_s: list[float] = field(default_factory=list)

    @classmethod
    def from_samples(cls, backend: str, beam_width: int, concurrency: int, latencies: list[float],
                     tokens: list[int], errors: list[str], seconds: float) -> "RowResult":
        lat = np.array(latencies, dtype=np.float64)
        ok = len(latencies)
        pct = (lambda q: float(np.percentile(lat, q))) if ok else (lambda q: float("nan"))
        total = int(sum(tokens))
        return cls(backend=backend, beam_width=beam_width, concurrency=concurrency, requests=ok, errors=len(errors),
                   tokens=total, seconds=seconds, tokens_per_s=total / seconds if seconds > 0 else 0.0,
                   requests_per_s=ok / seconds if seconds > 0 else 0.0, p50_s=pct(50), p99_s=pct(99),
                   mean_s=float(lat.mean()) if ok else float("nan"), tokens_per_request=total / ok if ok else 0.0,
                   first_error=errors[0] if errors else "", latencies_s=[round(x, 4) for x in latencies])

    def to_dict(self) -> dict:
        return asdict(self)


def _find(rows: Iterable[RowResult], backend: str, beam: int, conc: int) -> Optional[RowResult]:
    for r in rows:
        if (r.backend, r.beam_width, r.concurrency) == (backend, beam, conc):
            return r
    return None


def _keys(rows: list[RowResult]) -> list[tuple[int, int]]:
    return sorted({(r.beam_width, r.concurrency) for r in rows})


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not np.isfinite(a) or not np.isfinite(b) or b == 0:
        return None
    return a / b


def _fmt(x: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x:{spec}}{suffix}"


def table_rows(rows: list[RowResult]) -> list[list[str]]:
    """One line per (beam_width, concurrency): both backends side by side and the ratios."""
    out = []
    for beam, conc in _keys(rows):
        o, b = _find(rows, OURS, beam, conc), _find(rows, BASELINE, beam, conc)
        tr = ratio(o and o.tokens_per_s, b and b.tokens_per_s)
        lr = ratio(o and o.p50_s, b and b.p50_s)
        n = "/".join(str(r.requests) + (f"+{r.errors}err" if r.errors else "") for r in (o, b) if r)
        out.append([str(beam), str(conc), n,
                    _fmt(o and o.tokens_per_s), _fmt(b and b.tokens_per_s), _fmt(tr, ".2f", "x"),
                    _fmt(o and o.p50_s, ".2f"), _fmt(o and o.p99_s, ".2f"),
                    _fmt(b and b.p50_s, ".2f"), _fmt(b and b.p99_s, ".2f"), _fmt(lr, ".2f")])
    return out


HEADER = ["beam", "conc", "requests (ours/base)", "ours tok/s", "base tok/s", "tok/s ours/base",
          "ours p50 s", "ours p99 s", "base p50 s", "base p99 s", "p50 ours/base"]


def console_table(rows: list[RowResult]) -> str:
    body = table_rows(rows)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(HEADER)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(HEADER), line(["-" * w for w in widths])] + [line(r) for r in body])


def stream_lines(meta: dict) -> list[str]:
    """The bandwidth and, per backend, `one stream: X tok/s x Y MB/token = Z GB/s = F% of the measured W GB/s`."""
    bw, tb, streams = meta.get("bandwidth"), meta.get("token_bytes"), meta.get("one_stream") or {}
    if not bw:
        return []
    when = (f"the better of {' and '.join(f'{x:.2f}' for x in bw['measured'])} GB/s measured before the first "
            "server started and after the last one stopped" if "measured" in bw else "before any server started")
    when += f", load average {bw['load_1min']}" if "load_1min" in bw else ""
    out = [f"memory bandwidth: {bw['gb_s']:.2f} GB/s ({bw['method']}; {when}; its passes: "
           f"{', '.join(f'{x:.1f}' for x in bw['passes_gb_s'])} GB/s)"]
    if tb:
        out.append(f"bytes per decoded token ({tb['dtype']}): weights {tb['weights'] / 1e6:.2f} MB (every language-"
                   f"model tensor but the embedding table) + one embedding row {tb['embed_row'] / 1e3:.1f} kB + KV "
                   f"read {tb['kv'] / 1e6:.3f} MB ({tb['context']:.1f} positions on average) = {tb['total'] / 1e6:.2f} MB")
    for backend in (OURS, BASELINE):
        r = streams.get(backend)
        if r is None:
            continue
        if "error" in r:
            out.append(f"one stream ({backend}): failed: {r['error']}")
            continue
        out.append(f"one stream ({backend}): {r['tok_s']:.1f} tok/s x {tb['total'] / 1e6:.2f} MB/token = "
                   f"{r['gb_s']:.2f} GB/s = {100 * r['fraction']:.1f}% of the measured {bw['gb_s']:.2f} GB/s "
                   f"(median of {r['requests']} greedy requests x {r['tokens']} tokens streamed one at a time; "
                   f"(tokens - first response's) / (last token's arrival - first's); first token after "
                   f"{r['first_s']:.3f} s)")
    o, b = streams.get(OURS, {}), streams.get(BASELINE, {})
    if "tok_s" in o and "tok_s" in b:
        out.append(f"one stream ours/base: {o['tok_s'] / b['tok_s']:.2f}x")
    return out


def target_lines(rows: list[RowResult], meta: dict) -> list[str]:
    """The issue's targets, read off this run's rows and one-stream figure."""
    def tr(beam: int, conc: int) -> Optional[float]:
        o, b = _find(rows, OURS, beam, conc), _find(rows, BASELINE, beam, conc)
        return ratio(o and o.tokens_per_s, b and b.tokens_per_s)

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    out = []
    if (r := tr(1, 1)) is not None:
        out.append(f"greedy, concurrency 1: {r:.2f}x the baseline's tok/s (target >= 1.3x: {mark(r >= 1.3)})")
    s = (meta.get("one_stream") or {}).get(OURS, {})
    if "fraction" in s:
        f = s["fraction"]
        out.append(f"one stream: {100 * f:.1f}% of the measured bandwidth (target >= 50%: {mark(f >= 0.5)})")
    if (r := tr(4, 16)) is not None:
        out.append(f"beam 4, concurrency 16: {r:.2f}x the baseline's tok/s (target >= 6x: {mark(r >= 6)})")
    a, b = _find(rows, OURS, 4, 16), _find(rows, OURS, 4, 32)
    if a and b:
        out.append(f"beam 4: concurrency 32 {b.tokens_per_s:.1f} tok/s vs concurrency 16 {a.tokens_per_s:.1f} tok/s "
                   f"({b.tokens_per_s / a.tokens_per_s:.2f}x; target above: {mark(b.tokens_per_s > a.tokens_per_s)})")
    return out


def markdown(rows: list[RowResult], meta: dict) -> str:
    lines = [
        "# triton-vlm throughput benchmark",
        "",
        f"Every figure below comes from one run of `{meta.get('command', 'python -m bench.server.throughput')}`.",
        "",
        f"- model: {meta.get('model', '?')}",
        machine.line(meta),
        f"- machine: {meta.get('cpus', '?')} CPUs, torch threads per server process = "
        f"{meta.get('omp_threads', '?')}; load average before / after: {meta.get('load_before', '?')} / "
        f"{meta.get('load_after', '?')}",
        f"- run: {meta.get('date', '?')}, mode `{meta.get('mode', '?')}`; every request: one image + "
        f"`{meta.get('prompt', '')!r}`, max_tokens = min_tokens = {meta.get('max_tokens', '?')} (exactly that "
        f"many new tokens per request), greedy (beam 1) or beam search (beam 4), num_return_sequences 1",
        f"- closed loop: `concurrency` client threads, each sending its next request when the previous one "
        f"returns (gRPC, non-streamed); requests per row = max({meta.get('min_requests', '?')}, "
        f"{meta.get('requests_factor', '?')} x concurrency), fewer if the row's time budget "
        f"({meta.get('row_seconds', '?')} s) ran out",
        "- tok/s = generated tokens of the best (returned) sequence summed over the row's requests / the row's "
        "wall time; beam search's other beams are not counted. p50 / p99 = latency percentiles (numpy linear "
        "interpolation: with few requests p99 is close to the maximum)",
        f"- engine: llm `backend: engine`, max_rows {meta.get('max_rows', '?')}, kv_cache_tokens "
        f"{meta.get('kv_cache_tokens', '?')}; baseline: llm `backend: hf` (transformers generate(), one request "
        "at a time); both through the same Triton ensemble (preprocess -> vision -> llm)",
    ]
    if meta.get("capacity"):
        lines.append(f"- {meta['capacity']['text']}")
    lines += [f"- {x}" for x in stream_lines(meta)]
    lines += [
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---:" for _ in HEADER) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    errs = [r for r in rows if r.errors]
    if errs:
        lines += ["", "Errors:"] + [f"- {r.backend} beam {r.beam_width} conc {r.concurrency}: {r.errors} failed, "
                                    f"first: {r.first_error}" for r in errs]
    targets = target_lines(rows, meta)
    if targets:
        lines += ["", "Targets:"] + [f"- {x}" for x in targets]
    if meta.get("note"):
        lines += ["", meta["note"]]
    return "\n".join(lines) + "\n"


def plot_title(meta: dict) -> str:
    lm = meta.get("lm_params_m")
    model = f"{lm:.0f}M-param Llama" if lm else "Llama"
    return (f"random LLaVA, {model} + demo vision tower; {meta.get('mode', '?')} run {meta.get('date', '?')}; "
            f"max_tokens {meta.get('max_tokens', '?')}; torch threads {meta.get('omp_threads', '?')}\n"
            f"{meta.get('cpus', '?')} CPUs, load average {meta.get('load_before', '?')} -> {meta.get('load_after', '?')}")


def plot(rows: list[RowResult], path: Path, title: str = "") -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    beams = sorted({r.beam_width for r in rows})
    fig, axes = plt.subplots(2, len(beams), figsize=(5.5 * len(beams), 8), squeeze=False)
    colors = {OURS: "tab:blue", BASELINE: "tab:orange"}
    for j, beam in enumerate(beams):
        ax_t, ax_l = axes[0][j], axes[1][j]
        for backend in (OURS, BASELINE):
            rs = sorted((r for r in rows if r.backend == backend and r.beam_width == beam),
                        key=lambda r: r.concurrency)
            if not rs:
                continue
            c = [r.concurrency for r in rs]
            ax_t.plot(c, [r.tokens_per_s for r in rs], "o-", color=colors[backend], label=LABELS[backend])
            ax_l.plot(c, [r.p50_s for r in rs], "o-", color=colors[backend], label=f"{backend} p50")
            ax_l.plot(c, [r.p99_s for r in rs], "s--", color=colors[backend], alpha=0.6, label=f"{backend} p99")
        for ax in (ax_t, ax_l):
            ax.set_xscale("log", base=2)
            concs = sorted({r.concurrency for r in rows})
            ax.set_xticks(concs, [str(x) for x in concs])
            ax.set_xlabel("concurrency (closed-loop clients)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        ax_t.set_title(f"beam_width {beam}: throughput")
        ax_t.set_ylabel("generated tokens / s")
        ax_l.set_title(f"beam_width {beam}: latency")
        ax_l.set_ylabel("request latency (s)")
        ax_l.set_yscale("log")
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter  # noqa: PLC0415

        ax_l.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax_l.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax_l.yaxis.set_minor_formatter(NullFormatter())
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(json_path: Path) -> tuple[list[RowResult], dict]:
    import json  # noqa: PLC0415

    data = json.loads(Path(json_path).read_text())
    return [RowResult(**r) for r in data["rows"]], data["meta"]


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.common.report bench/results/results.json`: re-render the table, markdown and plot."""
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("json", type=Path)
    a = ap.parse_args(argv)
    rows, meta = load(a.json)
    stem = a.json.name[:-len("results.json")] if a.json.name.endswith("results.json") else ""
    md, png = a.json.with_name(f"{stem}results.md"), a.json.with_name(f"{stem}throughput.png")
    md.write_text(markdown(rows, meta))
    plot(rows, png, title=plot_title(meta))
    print(console_table(rows))
    print("\n".join(stream_lines(meta) + target_lines(rows, meta)))
    print(f"wrote {md}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
