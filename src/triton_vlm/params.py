"""Generation parameters and the request/result dataclasses shared by every generation backend.

Validation happens once, here: `GenerationParams.from_inputs` turns the optional scalar inputs of a request
(already unwrapped to Python values, missing ones absent) into parameters and `validate()`s them;
`GenerationRequest.validate(limits)` checks a request against the served model. Every problem raises
`InvalidArgument` naming the input, the value sent and what is allowed; the engine below only asserts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from . import names as N
from .errors import InvalidArgument

MAX_BEAM_WIDTH = 16
MAX_TOP_LOG_PROBS = 20  # OpenAI's bound on top_logprobs
# OpenAI's range for presence_penalty / frequency_penalty
PENALTY_RANGE = (-2.0, 2.0)
# bad_words / stop_words per request: each word costs a comparison per generated token, and bad words covering
# the whole vocabulary leave no token to choose
MAX_WORDS = 1024
MAX_WORD_IDS = 16384  # token ids over all words of one list
MAX_CACHE_SALT = 1024  # characters of a cache_salt
MAX_GUIDE = 1 << 20  # characters of a guided_decoding_guide (a schema / grammar), compiled once per distinct text
EARLY_STOPPING_WIRE = {N.EARLY_STOPPING_FALSE: False, N.EARLY_STOPPING_TRUE: True, N.EARLY_STOPPING_NEVER: "never"}


@dataclass(frozen=True)
class GuidedDecoding:
    """Grammar-constrained decoding (TensorRT-LLM's `guided_decoding_guide_type` / `guided_decoding_guide`).

    guide_type: one of `names.GUIDE_TYPES`: `json` (any JSON; the guide is ignored), `json_schema` (a JSON
    schema), `regex`, `ebnf_grammar` (GBNF, root rule `root`), `structural_tag` (xgrammar's structural tag
    JSON) or `choice` (a JSON list of strings, vLLM's guided_choice). The engine compiles it (engine/search/guided.py),
    refusing a guide the library cannot compile with InvalidArgument."""

    guide_type: str
    guide: str = ""

    def validate(self) -> None:
        if self.guide_type not in N.GUIDE_TYPES:
            raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE_TYPE} must be one of {', '.join(N.GUIDE_TYPES)}, "
                                  f"got {self.guide_type!r}")
        if not isinstance(self.guide, str):
            raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} must be text, got {type(self.guide).__name__}")
        if self.guide_type != "json" and not self.guide.strip():
            raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} is empty; {N.GUIDED_DECODING_GUIDE_TYPE} "
                                  f"{self.guide_type!r} needs one")
        if len(self.guide) > MAX_GUIDE:
            raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} holds {len(self.guide)} characters; at most "
                                  f"{MAX_GUIDE} are accepted")

    @classmethod
    def from_inputs(cls, guide_type: Optional[str], guide: Optional[str]) -> Optional["GuidedDecoding"]:
        """None when neither input was sent; a guide without its type is refused."""
        if guide_type is None or guide_type == "":
            if guide:
                raise InvalidArgument(f"{N.GUIDED_DECODING_GUIDE} needs {N.GUIDED_DECODING_GUIDE_TYPE} "
                                      f"(one of {', '.join(N.GUIDE_TYPES)})")
            return None
        g = cls(guide_type, guide or "")
        g.validate()
        return g


@dataclass(frozen=True)
class GuideLimits:
    """How the llm compiles guides (llm parameters, declared here once; `from_parameters` reads config.pbtxt's):
    `guide_compile_timeout_s`, how long a request waits for its grammar before it fails with InvalidArgument (the
    compile goes on in its worker and its grammar is cached when done); `guide_compile_workers`, the threads that
    compile (xgrammar releases the GIL); `guide_cache_mb`, the compiled grammars kept (bytes, LRU)."""

    compile_timeout_s: float = 5.0
    compile_workers: int = 2
    cache_mb: int = 256

    PARAMETERS = {"guide_compile_timeout_s": "compile_timeout_s", "guide_compile_workers": "compile_workers",
                  "guide_cache_mb": "cache_mb"}

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "GuideLimits":
        """From the llm's parameters (absent or empty: the default); a bad value raises InvalidArgument naming it."""
        values: dict[str, Any] = {}
        for name, attr in cls.PARAMETERS.items():
            text = str(params.get(name, "") or "").strip()
            if not text:
                continue
            kind = float if attr == "compile_timeout_s" else int
            try:
                values[attr] = kind(text)
            except ValueError:
                raise InvalidArgument(f"llm parameter {name} must be a number, got {text!r}") from None
        limits = cls(**values)
        limits.validate()
        return limits

    def validate(self) -> None:
        if not 0 < self.compile_timeout_s <= 3600:
            raise InvalidArgument(f"llm parameter guide_compile_timeout_s must be in (0, 3600] seconds, got "
                                  f"{self.compile_timeout_s}")
        if not 1 <= self.compile_workers <= 64:
            raise InvalidArgument(f"llm parameter guide_compile_workers must be in [1, 64], got "
                                  f"{self.compile_workers}")
        if self.cache_mb < 1:
            raise InvalidArgument(f"llm parameter guide_cache_mb must be >= 1, got {self.cache_mb}")


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    beam_width: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True / False / "never", as in transformers
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI's, over generated tokens
    no_repeat_ngram_size: int = 0
    end_ids: tuple[int, ...] = ()  # empty = the checkpoint's eos ids
    pad_id: int = -1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    do_sample: bool = False
    return_log_probs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    top_log_probs: int = 0  # k most likely tokens per new token (greedy / sampling)
    exclude_input_in_output: bool = False
    stream: bool = False
    guided: Optional[GuidedDecoding] = None  # grammar-constrained decoding

    @classmethod
    def from_inputs(cls, values: Mapping[str, Any], max_context: int | None = None) -> "GenerationParams":
        """`values`: input name -> Python scalar for the inputs the request carried."""

        def get(name, default=None):
            v = values.get(name)
            return default if v is None else v

        def integer(name, default):
            v = get(name, default)
            if v is None:
                return None
            if isinstance(v, float) and not v.is_integer():
                raise InvalidArgument(f"{name} must be an integer, got {v}")
            return int(v)

        def real(name, default):
            return float(get(name, default))

        if values.get(N.MAX_TOKENS) is None:
            raise InvalidArgument(f"{N.MAX_TOKENS} is required")
        beam_width = integer(N.BEAM_WIDTH, 1)
        es_raw = integer(N.EARLY_STOPPING, N.EARLY_STOPPING_FALSE)
        if es_raw not in EARLY_STOPPING_WIRE:
            raise InvalidArgument(
                f"{N.EARLY_STOPPING} must be 0 (False), 1 (True) or 2 (\"never\"), got {es_raw}")
        for name in (N.MIN_TOKENS, N.MIN_LENGTH):
            if integer(name, 0) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {integer(name, 0)}")
        end_id = integer(N.END_ID, None)
        seed = get(N.SEED, get(N.RANDOM_SEED))
        temperature, top_k = real(N.TEMPERATURE, 1.0), integer(N.TOP_K, 0)
        sampling_asked = any(values.get(k) is not None for k in (N.TEMPERATURE, N.TOP_K, N.TOP_P))
        params = cls(
            max_tokens=integer(N.MAX_TOKENS, None),
            beam_width=beam_width,
            num_return_sequences=integer(N.NUM_RETURN_SEQUENCES, 1),
            length_penalty=real(N.LENGTH_PENALTY, 1.0),
            early_stopping=EARLY_STOPPING_WIRE[es_raw],
            min_tokens=max(integer(N.MIN_TOKENS, 0), integer(N.MIN_LENGTH, 0)),
            repetition_penalty=real(N.REPETITION_PENALTY, 1.0),
            presence_penalty=real(N.PRESENCE_PENALTY, 0.0),
            frequency_penalty=real(N.FREQUENCY_PENALTY, 0.0),
            no_repeat_ngram_size=integer(N.NO_REPEAT_NGRAM_SIZE, 0),
            end_ids=() if end_id is None else (end_id,),
            pad_id=integer(N.PAD_ID, -1),
            temperature=temperature,
            top_k=top_k,
            top_p=real(N.TOP_P, 1.0),
            seed=None if seed is None else int(seed),
            # sampling when asked for (any of temperature / top_k / top_p sent) with beam_width 1;
            # temperature 0 or top_k 1 mean greedy.
            do_sample=beam_width == 1 and sampling_asked and temperature > 0 and top_k != 1,
            return_log_probs=bool(get(N.RETURN_LOG_PROBS, False)),
            return_num_input_tokens=bool(get(N.RETURN_NUM_INPUT_TOKENS, False)),
            return_num_output_tokens=bool(get(N.RETURN_NUM_OUTPUT_TOKENS, False)),
            top_log_probs=integer(N.RETURN_TOP_LOG_PROBS, 0),
            exclude_input_in_output=bool(get(N.EXCLUDE_INPUT_IN_OUTPUT, False)),
            stream=bool(get(N.STREAM, False)),
            guided=GuidedDecoding.from_inputs(get(N.GUIDED_DECODING_GUIDE_TYPE), get(N.GUIDED_DECODING_GUIDE)),
        )
        params.validate(max_context)
        return params

    def validate(self, max_context: int | None = None) -> None:
        """Every rule on the parameters themselves; raises InvalidArgument naming the input, the value and what
        is allowed. The one place these messages are made (the engine only asserts them afterwards)."""
        _int_in(N.MAX_TOKENS, self.max_tokens, 1, max_context)
        _int_in(N.BEAM_WIDTH, self.beam_width, 1, MAX_BEAM_WIDTH)
        nrs = _int_in(N.NUM_RETURN_SEQUENCES, self.num_return_sequences, 1, MAX_BEAM_WIDTH)
        if self.beam_width > 1 and nrs > self.beam_width:
            raise InvalidArgument(
                f"{N.NUM_RETURN_SEQUENCES} ({nrs}) must be <= {N.BEAM_WIDTH} ({self.beam_width}) in beam search")
        if self.beam_width == 1 and nrs > 1 and not self.do_sample:
            raise InvalidArgument(
                f"{N.NUM_RETURN_SEQUENCES} > 1 needs beam_width > 1 or sampling (temperature > 0, top_k or top_p)")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidArgument(f"{N.EARLY_STOPPING} must be True, False or \"never\", got {self.early_stopping!r}")
        _real_in(N.LENGTH_PENALTY, self.length_penalty, -1e6, 1e6)
        _int_in(N.MIN_TOKENS, self.min_tokens, 0)
        _real_in(N.REPETITION_PENALTY, self.repetition_penalty, 0.0, lo_open=True)
        _real_in(N.PRESENCE_PENALTY, self.presence_penalty, *PENALTY_RANGE)
        _real_in(N.FREQUENCY_PENALTY, self.frequency_penalty, *PENALTY_RANGE)
        _int_in(N.NO_REPEAT_NGRAM_SIZE, self.no_repeat_ngram_size, 0)
        for e in self.end_ids:
            _int_in(N.END_ID, e, 0)
        _int_in(N.PAD_ID, self.pad_id, -1)
        _real_in(N.TEMPERATURE, self.temperature, 0.0, lo_open=self.do_sample)
        _int_in(N.TOP_K, self.top_k, 0)
        _real_in(N.TOP_P, self.top_p, 0.0, 1.0, lo_open=True)
        _int_in(N.RETURN_TOP_LOG_PROBS, self.top_log_probs, 0, MAX_TOP_LOG_PROBS)
        if self.top_log_probs and self.beam_width > 1:
            raise InvalidArgument(f"{N.RETURN_TOP_LOG_PROBS} needs beam_width 1 (greedy or sampling), got "
                                  f"beam_width {self.beam_width}")
        if self.guided is not None:
            if not isinstance(self.guided, GuidedDecoding):
                raise InvalidArgument(f"guided must be a GuidedDecoding, got {type(self.guided).__name__}")
            self.guided.validate()


def _int_in(name: str, v: int, lo: int, hi: int | None = None) -> int:
    if v < lo or (hi is not None and v > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidArgument(f"{name} must be {allowed}, got {v}")
    return v


def _real_in(name: str, v: float, lo: float, hi: float | None = None, lo_open: bool = False) -> float:
    if not math.isfinite(v) or v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        allowed = lo_s if hi is None else f"{lo_s} and <= {hi}"
        raise InvalidArgument(f"{name} must be a finite number {allowed}, got {v}")
    return v


def check_ids(what: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = [int(i) for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise InvalidArgument(f"{what} holds ids outside [0, {vocab_size}): {bad[:5]}")


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served model's vocabulary, context and end ids."""

    vocab_size: int
    context_length: int
    eos_ids: tuple[int, ...]


@dataclass
class GenerationRequest:
    """One prompt to generate from; built by the llm adapter from the tensors preprocess + vision produced."""

    request_id: str
    input_ids: list[int]  # prompt ids, N placeholder ids per image
    params: GenerationParams
    image_embeds: Any = None  # torch.Tensor [images, T, hidden] or None
    bad_words_ids: list[list[int]] = field(default_factory=list)
    stop_words_ids: list[list[int]] = field(default_factory=list)
    dropped_images: int = 0
    adapter: Any = None  # a `lora.format.Adapter` applied to every row of this request, or None (base model)
    cache_salt: Optional[str] = None  # vLLM's: prefix-cache blocks are shared only between requests of one salt
    image_sizes: Any = None  # [images, 2] (height, width) of the prompt's images: M-RoPE's grids (Qwen2-VL), or None
    media_grids: Any = None  # [images, 3] (t, h, w) patches of each image / video (Qwen2-VL), or None (from sizes)
    media_seconds: Any = None  # [images] a video's seconds per temporal patch (Qwen2.5-VL's time positions)
    rope: Any = None  # M-RoPE (Qwen2-VL): the prompt's 3-D positions and delta (`engine.mrope.MRopePrompt`), or None

    def end_ids(self, limits: ModelLimits) -> tuple[int, ...]:
        return tuple(self.params.end_ids or limits.eos_ids)

    def validate(self, limits: ModelLimits) -> None:
        """The request against the model (its parameters were validated when they were built): raises
        InvalidArgument naming what is wrong and what is allowed."""
        ids, p = self.input_ids, self.params
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgument("request_id must be a non-empty string")
        if not isinstance(p, GenerationParams):
            raise InvalidArgument(f"params must be a GenerationParams, got {type(p).__name__}")
        p.validate()
        check_cache_salt(self.cache_salt)
        if len(ids) == 0:
            raise InvalidArgument("input_ids is empty; at least one prompt token is needed")
        check_ids("input_ids", ids, limits.vocab_size)
        check_context(len(ids), p.max_tokens, limits.context_length)
        check_ids(N.END_ID, self.end_ids(limits), limits.vocab_size)
        for what, words in ((N.BAD_WORDS, self.bad_words_ids), (N.STOP_WORDS, self.stop_words_ids)):
            check_word_count(what, len(words))
            n_ids = sum(len(w) for w in words)
            if n_ids > MAX_WORD_IDS:
                raise InvalidArgument(f"{what} hold {n_ids} token ids in all; at most {MAX_WORD_IDS} are accepted")
            for w in words:
                check_ids(what, w, limits.vocab_size)
        n_eos = len(self.end_ids(limits))
        if p.beam_width > 1 and max(2, 1 + n_eos) * p.beam_width > p.beam_width * limits.vocab_size:
            raise InvalidArgument(f"beam_width {p.beam_width} is too large for a vocabulary of {limits.vocab_size}")
        if p.top_log_probs > limits.vocab_size:
            raise InvalidArgument(f"{N.RETURN_TOP_LOG_PROBS} {p.top_log_probs} exceeds the vocabulary "
                                  f"({limits.vocab_size} tokens)")


def check_cache_salt(salt: Optional[str]) -> None:
    """None (no salt) or non-empty text of at most MAX_CACHE_SALT characters (an empty salt is refused, as vLLM
    refuses it: it would look like isolation and be none)."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise InvalidArgument(f"{N.CACHE_SALT} must be a non-empty string if provided, got {salt!r}")
    if len(salt) > MAX_CACHE_SALT:
        raise InvalidArgument(f"{N.CACHE_SALT} holds {len(salt)} characters; at most {MAX_CACHE_SALT} are accepted")


def check_word_count(what: str, n: int) -> None:
    """At most MAX_WORDS bad / stop words per request (checked before tokenizing them, and again in the llm)."""
    if n > MAX_WORDS:
        raise InvalidArgument(f"{what} holds {n} words; at most {MAX_WORDS} are accepted")


def check_context(prompt_len: int, max_tokens: int, context_length: int) -> None:
    if prompt_len + max_tokens > context_length:
        raise InvalidArgument(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds the "
            f"context length {context_length}; max_tokens can be at most {max(0, context_length - prompt_len)}")


@dataclass
class Sequence_:
    """One returned sequence."""

    token_ids: list[int]  # new tokens only
    text: str  # detokenized new tokens
    cum_log_prob: float = 0.0  # beam search: the ranking (length-penalised) score
    log_probs: list[float] = field(default_factory=list)  # per new token
    top_log_probs: list[list[float]] = field(default_factory=list)  # [new_tokens][k] when asked, best first
    top_ids: list[list[int]] = field(default_factory=list)  # [new_tokens][k] their token ids


@dataclass(frozen=True)
class KVUsage:
    """One request's KV-cache blocks (TensorRT-LLM's per-request KV metrics): its prompt's full blocks found in the
    prefix cache (reused) and not (missed); the distinct blocks its rows held when it finished (total), of which
    new = those not reused."""

    reused_blocks: int = 0
    missed_blocks: int = 0
    new_blocks: int = 0
    total_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        seen = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / seen if seen else 0.0


@dataclass(frozen=True)
class RequestStats:
    """Where one request's time went inside the engine (seconds from its submission); on final results."""

    prompt_tokens: int
    generated_tokens: int  # decode steps run (new tokens of the longest returned sequence)
    queue_s: float  # submitted -> admitted (rows and KV blocks reserved)
    ttft_s: Optional[float]  # submitted -> first new token (None if it never got one)
    e2e_s: float  # submitted -> finished
    # ns since the epoch on the engine's clock: arrival (submitted), first scheduled (admitted), first and last new
    # token (0: never reached)
    times_ns: tuple[int, int, int, int] = (0, 0, 0, 0)
    kv: KVUsage = field(default_factory=KVUsage)

    @property
    def tpot_s(self) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.generated_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.generated_tokens - 1)


@dataclass
class GenerationResult:
    """Either a streamed piece (final=False) or the last response of a request (final=True)."""

    request_id: str
    sequences: list[Sequence_]  # streamed piece: new ids/text of `sequence_index` only
    final: bool
    sequence_index: int = 0
    error: Optional[Exception] = None
    stats: Optional[RequestStats] = None  # final results of the engine
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed for this request)


def words_from_flat(flat: Sequence[int]) -> list[list[int]]:
    """Decode the length-prefixed word lists used between preprocess and llm: [n, id_1..id_n, m, ...]; a length
    of 0 followed by zeros only is padding (the rows of a batched request share one width)."""
    out, i = [], 0
    flat = [int(t) for t in flat]
    while i < len(flat):
        n = flat[i]
        if n == 0 and not any(flat[i:]):
            break
        if n <= 0 or i + 1 + n > len(flat):
            raise InvalidArgument(f"malformed word list at position {i}: length {n}")
        out.append([int(t) for t in flat[i + 1:i + 1 + n]])
        i += 1 + n
    return out


def words_to_flat(words: Sequence[Sequence[int]]) -> list[int]:
    flat: list[int] = []
    for w in words:
        if w:
            flat.append(len(w))
            flat.extend(int(t) for t in w)
    return flat


# --- media budget (the preprocess model's parameters `max_media_tokens` / `max_media_bytes`) --------------------
# What one request's images and videos may cost, computed from their headers before any pixel is decoded
# (preprocess/service.py): placeholder tokens of every medium (also those truncation will drop), and bytes of pixels
# held (each image decoded at its own size, RGB uint8; each video's kept frames resized, RGB uint8; and every
# medium's pixel_values, float32). 65,536 tokens and 1 GiB take a whole 32k context of Qwen2-VL video at once.
DEFAULT_MAX_MEDIA_TOKENS = 65536
DEFAULT_MAX_MEDIA_BYTES = 1 << 30
DEFAULT_MAX_VIDEOS = 2  # videos per request (the preprocess model's `max_videos`; the OpenAI front end counts too)


@dataclass(frozen=True)
class MediaCost:
    """One image's or video's cost, known before decoding: its tokens and the bytes of pixels it will hold."""

    what: str  # e.g. "videos[0]"
    tokens: int
    nbytes: int
    detail: str  # what was counted, for the error text (size, frames, grid)


def check_media_budget(costs: Sequence[MediaCost], max_tokens: int, max_bytes: int) -> None:
    """InvalidArgument naming the medium that takes a request past `max_tokens` tokens or `max_bytes` bytes."""
    tokens = nbytes = 0
    for c in costs:
        tokens, nbytes = tokens + c.tokens, nbytes + c.nbytes
        if tokens > max_tokens:
            raise InvalidArgument(f"{c.what} ({c.detail}) brings the request's images and videos to {tokens} tokens; "
                                  f"at most {max_tokens} are accepted per request (max_media_tokens); send fewer "
                                  "or smaller media")
        if nbytes > max_bytes:
            raise InvalidArgument(f"{c.what} ({c.detail}) brings the request's decoded pixels to {nbytes} bytes; at "
                                  f"most {max_bytes} are accepted per request (max_media_bytes); send fewer or "
                                  "smaller media")
