"""`triton-vlm-client`: one prompt (+ images) in, the answer out.

Exit codes: 0 success, 1 the server (or the connection) failed the request — its message goes to stderr,
2 bad command line or unreadable image file, 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from . import protocol as P
from .client import DEFAULT_TIMEOUT, DEFAULT_URLS, VLMClient
from .errors import VLMClientError
from .request import DEFAULT_MAX_TOKENS, ensure_image_markers

PROG = "triton-vlm-client"
_EARLY = {"true": True, "false": False, "never": "never"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Ask the triton-vlm ensemble (Triton Inference Server) about a prompt and images.",
        epilog="Options left out are not sent, so the server's defaults apply; the client sends max_tokens "
               f"(default {DEFAULT_MAX_TOKENS}) and exclude_input_in_output (default: exclude, i.e. only the "
               "answer). With --image files and fewer <image> markers in the prompt than files, the missing "
               "markers are prepended ('<image>\\n' each). Exit codes: 0 ok, 1 request failed (server message "
               "on stderr), 2 bad arguments or unreadable image.")
    p.add_argument("prompt", help="the prompt; '-' reads it from stdin. May contain <image> markers and inline "
                                  "<img src=\"data:image/...;base64,...\"> tags (sent as they are)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="image file, one per <image> marker (repeatable, in order)")
    g = p.add_argument_group("generation")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="new tokens at most (default %(default)s)")
    g.add_argument("--beam-width", type=int)
    g.add_argument("--num-return-sequences", type=int)
    g.add_argument("--length-penalty", type=float)
    g.add_argument("--early-stopping", choices=sorted(_EARLY), help="beam search stop rule")
    g.add_argument("--min-tokens", type=int)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--presence-penalty", type=float, help="OpenAI's presence penalty (-2.0..2.0)")
    g.add_argument("--frequency-penalty", type=float, help="OpenAI's frequency penalty (-2.0..2.0)")
    g.add_argument("--no-repeat-ngram-size", type=int)
    g.add_argument("--bad-word", action="append", default=[], metavar="W", help="never generate W (repeatable)")
    g.add_argument("--stop-word", action="append", default=[], metavar="W", help="stop after W (repeatable)")
    g.add_argument("--end-id", type=int)
    g.add_argument("--pad-id", type=int)
    g.add_argument("--temperature", type=float, help="sampling temperature (setting it turns sampling on)")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--return-log-probs", action="store_true", default=None)
    x = g.add_mutually_exclusive_group()
    x.add_argument("--exclude-input-in-output", dest="exclude_input_in_output", action="store_true",
                   default=True, help="output only the answer (default)")
    x.add_argument("--include-input", dest="exclude_input_in_output", action="store_false",
                   help="output the prompt followed by the answer")
    lo = p.add_argument_group("LoRA adapter")
    lo.add_argument("--lora-name", help="an adapter of the server's registry, e.g. french")
    lo.add_argument("--lora-task-id", type=int, help="an adapter id the server has cached or on disk")
    lo.add_argument("--lora-dir", help="send this adapter (a PEFT folder or TensorRT-LLM's .npy pair) with\n"
                                       "--lora-task-id; later requests may send the id alone")
    o = p.add_argument_group("output and connection")
    o.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    o.add_argument("--json", action="store_true",
                   help="machine output: one JSON object (with --stream: one JSON object per line per piece)")
    o.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    o.add_argument("--url", help=f"server address (default {DEFAULT_URLS['grpc']} for grpc, "
                                 f"{DEFAULT_URLS['http']} for http)")
    o.add_argument("--model", default=P.MODEL, help="model name (default %(default)s)")
    o.add_argument("--api-key", help="the server's API key (a server started with --api-key; default "
                                     f"${P.API_KEY_ENV}, which keeps it off this command line)")
    o.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds for the whole request "
                                                                           "(default %(default)s)")
    return p


def params_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The generation keyword arguments of VLMClient.generate/stream the command line asked for."""
    params: dict[str, Any] = {P.MAX_TOKENS: ns.max_tokens, P.EXCLUDE_INPUT_IN_OUTPUT: ns.exclude_input_in_output}
    for name in (P.BEAM_WIDTH, P.NUM_RETURN_SEQUENCES, P.LENGTH_PENALTY, P.MIN_TOKENS, P.REPETITION_PENALTY,
                 P.PRESENCE_PENALTY, P.FREQUENCY_PENALTY, P.NO_REPEAT_NGRAM_SIZE, P.END_ID, P.PAD_ID, P.TEMPERATURE, P.TOP_K, P.TOP_P, P.SEED,
                 P.RETURN_LOG_PROBS):
        value = getattr(ns, name)
        if value is not None:
            params[name] = value
    if ns.early_stopping is not None:
        params[P.EARLY_STOPPING] = _EARLY[ns.early_stopping]
    if ns.lora_name:
        params[P.LORA_NAME] = ns.lora_name
    if ns.lora_task_id is not None:
        params[P.LORA_TASK_ID] = ns.lora_task_id
    if ns.lora_dir:
        params["lora_dir"] = ns.lora_dir
    if ns.bad_word:
        params[P.BAD_WORDS] = list(ns.bad_word)
    if ns.stop_word:
        params[P.STOP_WORDS] = list(ns.stop_word)
    return params


def prompt_from_args(ns: argparse.Namespace, stdin=None) -> str:
    prompt = (stdin or sys.stdin).read() if ns.prompt == "-" else ns.prompt
    return ensure_image_markers(prompt, len(ns.image))


def _print_result(result, ns, out) -> None:
    if ns.json:
        out.write(json.dumps(result.to_dict(), ensure_ascii=False) + "\n")
        return
    for k, text in enumerate(result.texts):
        if len(result.texts) > 1:
            out.write(f"=== sequence {k} ===\n")
        out.write(text + "\n")
    if result.cum_log_probs is not None:
        sys.stderr.write("cum_log_probs: " + " ".join(f"{v:.4f}" for v in result.cum_log_probs) + "\n")
    if result.dropped_images:
        sys.stderr.write(f"note: the server dropped {result.dropped_images} image(s) to fit the context\n")


def _stream(client: VLMClient, prompt: str, ns, params, out) -> None:
    """Sequence 0 is printed live; other sequences (sampling with num_return_sequences > 1) after it."""
    others: dict[int, list[str]] = {}
    for piece in client.stream(prompt, ns.image, **params):
        if ns.json:
            out.write(json.dumps(piece.to_dict(), ensure_ascii=False) + "\n")
        elif piece.sequence_index == 0:
            out.write(piece.text)
        else:
            others.setdefault(piece.sequence_index, []).append(piece.text)
            continue
        out.flush()
    if not ns.json:
        out.write("\n")
        for k in sorted(others):
            out.write(f"=== sequence {k} ===\n{''.join(others[k])}\n")
        out.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    out = sys.stdout
    try:
        prompt = prompt_from_args(ns)
        client = VLMClient(ns.url, protocol=ns.protocol, model=ns.model, timeout=ns.timeout, api_key=ns.api_key)
        params = params_from_args(ns)
        if ns.stream:
            _stream(client, prompt, ns, params, out)
        else:
            _print_result(client.generate(prompt, ns.image, **params), ns, out)
        return 0
    except VLMClientError as e:
        out.flush()
        status = f" ({e.status})" if e.status is not None else ""
        sys.stderr.write(f"{PROG}: error{status}: {e.message}\n")
        return 1
    except (OSError, ValueError, TypeError) as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
