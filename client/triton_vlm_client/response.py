"""What comes back: the result of a request, the pieces of a streamed one, and the parsing of both wire
formats into them. Outputs arrive as `{name: flat list}` (gRPC arrays flattened, HTTP JSON values, where
Triton writes a one-element tensor as a bare scalar and any other tensor as a flat list).
"""
from __future__ import annotations

import codecs
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional

from . import protocol as P
from .errors import VLMClientError

Outputs = Mapping[str, list]  # output name -> flattened values (BYTES as bytes or str)


@dataclass
class GenerateResult:
    texts: list[str]  # one per returned sequence, best first
    output_ids: list[list[int]]  # [sequences][sequence_length] token ids, padding removed
    sequence_lengths: list[int]  # [sequences]
    cum_log_probs: Optional[list[float]] = None  # [sequences]; None unless return_log_probs
    output_log_probs: Optional[list[list[float]]] = None  # [sequences][new_tokens]; None unless return_log_probs
    dropped_images: int = 0  # images the server removed when truncating the prompt
    num_input_tokens: Optional[int] = None  # prompt tokens (image tokens included) with return_num_input_tokens
    num_output_tokens: Optional[int] = None  # new tokens of all sequences with return_num_output_tokens
    num_cached_tokens: Optional[int] = None  # prompt tokens the server's prefix cache spared (return_num_input_tokens)

    @property
    def text(self) -> str:
        """The first (best) sequence."""
        return self.texts[0] if self.texts else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StreamPiece:
    text: str  # new text of `sequence_index`; the pieces of one sequence concatenate to its final text
    sequence_index: int = 0
    token_ids: list[int] = field(default_factory=list)  # the new token ids
    log_probs: Optional[list[float]] = None  # their log probs when return_log_probs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- helpers


def flat(value: Any) -> list:
    """A JSON output value (scalar or list, possibly nested) or a numpy array -> flat Python list."""
    if value is None:
        return []
    if hasattr(value, "reshape") and hasattr(value, "tolist"):  # numpy array
        return value.reshape(-1).tolist()
    if isinstance(value, list):
        out: list = []
        for v in value:
            out.extend(flat(v) if isinstance(v, list) else [v])
        return out
    return [value]


def _rows(values: list, n: int) -> list[list]:
    """Flat [n * m] -> n rows of m."""
    if n <= 0:
        return []
    m = len(values) // n
    return [values[i * m:(i + 1) * m] for i in range(n)]


def _text(x: Any) -> str:
    return x.decode("utf-8", errors="replace") if isinstance(x, (bytes, bytearray)) else str(x)


# ---------------------------------------------------------------- final result


def parse_result(outputs: Outputs, log_probs: bool = False) -> GenerateResult:
    """The outputs of the one final response of a non-streamed request -> GenerateResult."""
    if P.TEXT_OUTPUT not in outputs:
        raise VLMClientError("PROTOCOL", f"the response has no {P.TEXT_OUTPUT}: {sorted(outputs)}")
    texts = [_text(t) for t in flat(outputs[P.TEXT_OUTPUT])]
    n = len(texts)
    ids = _rows([int(i) for i in flat(outputs.get(P.OUTPUT_IDS))], n)
    lengths = [int(x) for x in flat(outputs.get(P.SEQUENCE_LENGTH))]
    if len(lengths) == n and len(ids) == n:
        ids = [row[:length] for row, length in zip(ids, lengths)]
    elif len(ids) == n:
        lengths = [len(row) for row in ids]
    cum = olp = None
    if log_probs:
        cum = [float(x) for x in flat(outputs.get(P.CUM_LOG_PROBS))] or None
        olp = _rows([float(x) for x in flat(outputs.get(P.OUTPUT_LOG_PROBS))], n) or None
    dropped = flat(outputs.get(P.DROPPED_IMAGES))
    n_in, n_out = flat(outputs.get(P.NUM_INPUT_TOKENS)), flat(outputs.get(P.NUM_OUTPUT_TOKENS))
    n_cached = flat(outputs.get(P.NUM_CACHED_TOKENS))
    return GenerateResult(texts=texts, output_ids=ids, sequence_lengths=lengths, cum_log_probs=cum,
                          output_log_probs=olp, dropped_images=int(dropped[0]) if dropped else 0,
                          num_input_tokens=int(n_in[0]) if n_in else None,
                          num_output_tokens=int(n_out[0]) if n_out else None,
                          num_cached_tokens=int(n_cached[0]) if n_cached else None)


# ---------------------------------------------------------------- streamed pieces


class PieceDecoder:
    """Streamed responses -> StreamPieces. gRPC pieces are bytes and are decoded incrementally per sequence,
    so a character split across two responses is not broken."""

    def __init__(self, log_probs: bool = False):
        self.log_probs = log_probs
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}

    def _decode(self, index: int, x: Any) -> str:
        if not isinstance(x, (bytes, bytearray)):
            return str(x)
        dec = self._decoders.get(index)
        if dec is None:
            dec = self._decoders[index] = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return dec.decode(bytes(x))

    def pieces(self, outputs: Outputs) -> list[StreamPiece]:
        if P.TEXT_OUTPUT not in outputs:  # e.g. the empty final response of a decoupled model
            return []
        texts = flat(outputs[P.TEXT_OUTPUT])
        n = len(texts)
        ids = _rows([int(i) for i in flat(outputs.get(P.OUTPUT_IDS))], n)
        lengths = [int(x) for x in flat(outputs.get(P.SEQUENCE_LENGTH))]
        lps = _rows([float(x) for x in flat(outputs.get(P.OUTPUT_LOG_PROBS))], n)
        seq_index = flat(outputs.get(P.SEQUENCE_INDEX))
        out = []
        for k, t in enumerate(texts):
            # one text per response: it belongs to `sequence_index`; several: row k is sequence k
            index = int(seq_index[0]) if n == 1 and seq_index else k
            row = ids[k] if k < len(ids) else []
            if k < len(lengths):
                row = row[:lengths[k]]
            lp = None
            if self.log_probs and k < len(lps):
                lp = lps[k][:len(row)] if row else lps[k]
            text = self._decode(index, t)
            if text or row:  # bytes of an unfinished character and no ids: nothing to report yet
                out.append(StreamPiece(text, index, row, lp))
        return out

    def flush(self) -> list[StreamPiece]:
        """Bytes left undecoded at the end of the stream (only with malformed UTF-8)."""
        out = []
        for index, dec in self._decoders.items():
            rest = dec.decode(b"", final=True)
            if rest:
                out.append(StreamPiece(rest, index, [], None))
        return out


# ---------------------------------------------------------------- HTTP


def json_error(body: bytes) -> Optional[str]:
    """The message of a Triton HTTP error body (`{"error": "..."}`, possibly as an SSE `data:` line)."""
    text = body.decode("utf-8", errors="replace").strip()
    for candidate in [text] + [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]:
        try:
            obj = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(obj, dict) and "error" in obj:
            return str(obj["error"])
    return None


def iter_sse(lines: Iterable[bytes]) -> Iterator[dict]:
    """Server-Sent Events -> the JSON object of each event's `data:` (multi-line data joined by newlines).

    Comment lines (`:`) and other fields (`event:`, `id:`, `retry:`) are ignored; an event ends at a blank
    line or at the end of the stream.
    """
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield _sse_json("\n".join(data))
                data = []
            continue
        if line.startswith(":"):
            continue
        field_, _, value = line.partition(":")
        if field_ == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield _sse_json("\n".join(data))


def _sse_json(data: str) -> dict:
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise VLMClientError("PROTOCOL", f"bad server-sent event {data[:200]!r}: {e}") from None
    if not isinstance(obj, dict):
        raise VLMClientError("PROTOCOL", f"server-sent event is not a JSON object: {data[:200]!r}")
    return obj
