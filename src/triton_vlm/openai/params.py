"""An OpenAI request's sampling fields -> the ensemble's generation inputs (`Plan`).

Ranges the engine checks (temperature, top_p, penalties, max_tokens against the context, ...) are left to it:
its INVALID_ARG messages reach the client unchanged. Checked here is only what belongs to the API:

- `n` choices: beam search returns the `n` best of `best_of` beams (vLLM's `use_beam_search`, beam width
  `best_of`, default `n`); sampling returns `n` samples (`num_return_sequences`), or the `n` most likely of
  `best_of` samples; greedy decoding is deterministic, so `n` greedy choices are one generation returned `n`
  times (the engine refuses `num_return_sequences` > 1 without sampling or beams).
- no temperature / top_p / top_k in the request: the checkpoint's generation_config decides (`served.py`);
  `temperature` 0 is greedy. vLLM's `top_k` -1 (off) is the ensemble's 0.
- `stop`: sent as the ensemble's `stop_words` (ends a sequence early, at the token level) and matched on the
  text by the front end (`choices.StopMatcher`), which removes the stop string as OpenAI does.
- `ignore_eos`: `min_tokens` = `max_tokens` (EOS is never chosen).
- `cache_salt` (vLLM's): the ensemble's `cache_salt`, a non-empty string (400 otherwise, as vLLM answers). With
  --api-key the salt sent is an HMAC-SHA256 under the key of the client's salt (or of none), so prefix-cache
  blocks are never shared with clients that do not hold the key (Triton's own clients, or front ends with other
  keys); one key is one tenant: clients sharing a key share blocks unless their salts differ.
  `prompt_cache_key` (OpenAI's) is accepted and has no effect: OpenAI defines it as a routing hint to raise hit
  rates, not as isolation, so mapping it to the salt would split the sharing its users ask for.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Optional, Union

from .. import names as N
from ..params import MAX_CACHE_SALT
from .errors import bad_request
from .schemas import MAX_N, MAX_TOP_LOGPROBS, ChatCompletionRequest, CompletionRequest

MAX_STOP = 16
EARLY_STOPPING = {False: N.EARLY_STOPPING_FALSE, True: N.EARLY_STOPPING_TRUE, "never": N.EARLY_STOPPING_NEVER}


@dataclass
class Plan:
    inputs: dict[str, object] = field(default_factory=dict)  # ensemble generation input -> scalar
    max_tokens: Optional[int] = None
    n: int = 1  # choices returned
    copies: int = 1  # greedy n > 1: the one generation returned this many times
    rank_best_of: bool = False  # sampling best_of > n: keep the n best by cumulative log prob
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    stream_engine: bool = False  # stream from the engine (False: stream=true answered from the final response)
    include_usage: bool = False
    continuous_usage: bool = False
    ignore_eos: bool = False
    beam: bool = False
    cache_salt: Optional[str] = None  # the client's (see tenant_salt for what is sent)


def _stop_list(stop: Union[str, list[str], None]) -> list[str]:
    words = [stop] if isinstance(stop, str) else list(stop or [])
    words = [w for w in words if w]
    if len(words) > MAX_STOP:
        raise bad_request(f"stop holds {len(words)} strings; at most {MAX_STOP} are accepted", param="stop")
    return words


def _sampling(body, defaults: dict, inputs: dict) -> bool:
    """Fill temperature / top_p / top_k; True when the request samples (the ensemble's own rule)."""
    given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k") if getattr(body, k) is not None}
    values = given if given else dict(defaults)
    if "top_k" in values and values["top_k"] < 0:
        if values["top_k"] != -1:
            raise bad_request(f"top_k must be -1 (off) or >= 0, got {values['top_k']}", param="top_k")
        values["top_k"] = 0
    for k, name in (("temperature", N.TEMPERATURE), ("top_p", N.TOP_P), ("top_k", N.TOP_K)):
        if k in values:
            inputs[name] = values[k]
    temperature = values.get("temperature", 1.0)
    return bool(values) and temperature > 0 and values.get("top_k", 0) != 1


def make_plan(body: Union[ChatCompletionRequest, CompletionRequest], defaults: dict) -> Plan:
    p = Plan(max_tokens=body.max_new_tokens, stream=body.stream, ignore_eos=body.ignore_eos)
    inputs = p.inputs
    if not 1 <= body.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    p.n = body.n
    if body.stream_options is not None:
        if not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        p.include_usage = body.stream_options.include_usage or body.stream_options.continuous_usage_stats
        p.continuous_usage = body.stream_options.continuous_usage_stats
    _logprobs(body, p)
    sampling = _sampling(body, defaults, inputs)
    if body.seed is not None:
        if body.seed < 0 or body.seed >= 2**64:
            raise bad_request(f"seed must be in [0, 2**64), got {body.seed}", param="seed")
        inputs[N.SEED] = body.seed
    for k, name in (("presence_penalty", N.PRESENCE_PENALTY), ("frequency_penalty", N.FREQUENCY_PENALTY),
                    ("repetition_penalty", N.REPETITION_PENALTY)):
        value = getattr(body, k)
        if value is not None:
            inputs[name] = value
    if body.min_tokens:
        inputs[N.MIN_TOKENS] = body.min_tokens
    p.stop = _stop_list(body.stop)
    p.cache_salt = _cache_salt(body.cache_salt)
    _choices(body, p, sampling)
    if p.logprobs or p.rank_best_of:
        inputs[N.RETURN_LOG_PROBS] = True
    if p.top_logprobs:
        inputs[N.RETURN_TOP_LOG_PROBS] = p.top_logprobs
    # the engine's streamed pieces carry their tokens' log probs for greedy and sampling; beam search knows them
    # only at the end, so a streamed beam search with logprobs is run unstreamed and sent as chunks at its end
    p.stream_engine = p.stream and not (p.logprobs and p.beam)
    return p


def _cache_salt(salt: Optional[str]) -> Optional[str]:
    if salt is None:
        return None
    if not salt:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT:
        raise bad_request(f"cache_salt holds {len(salt)} characters; at most {MAX_CACHE_SALT} are accepted",
                          param="cache_salt")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("cache_salt must be valid Unicode text (it holds a lone surrogate)",
                          param="cache_salt") from None
    return salt


def tenant_salt(api_key: Optional[str], salt: Optional[str]) -> Optional[str]:
    """The salt sent to Triton: the client's as it is without an API key; with one, an HMAC under the key of
    the client's salt (or of none), so that only holders of the key can ever share blocks with these requests."""
    if not api_key:
        return salt
    msg = b"triton-vlm cache_salt\0" + (b"\0" if salt is None else b"\1" + salt.encode("utf-8"))
    return "key:" + hmac.new(api_key.encode("utf-8", "surrogatepass"), msg, hashlib.sha256).hexdigest()


def _logprobs(body, p: Plan) -> None:
    if isinstance(body, ChatCompletionRequest):
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        p.logprobs, p.top_logprobs = body.logprobs, top or 0
    else:
        p.logprobs, p.top_logprobs = body.logprobs is not None, body.logprobs or 0
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}",
                          param="top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs")


def _choices(body, p: Plan, sampling: bool) -> None:
    n, best_of = body.n, body.best_of
    if best_of is not None and best_of < n:
        raise bad_request(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if body.use_beam_search:
        width = best_of or n
        p.beam = True
        p.inputs.update({N.BEAM_WIDTH: width, N.NUM_RETURN_SEQUENCES: n, N.LENGTH_PENALTY: body.length_penalty,
                         N.EARLY_STOPPING: EARLY_STOPPING[body.early_stopping]})
        return
    if body.length_penalty != 1.0 or body.early_stopping is not False:
        raise bad_request("length_penalty and early_stopping apply to beam search only (use_beam_search: true)",
                          param="length_penalty" if body.length_penalty != 1.0 else "early_stopping")
    if not sampling:
        if best_of is not None and best_of > 1:
            raise bad_request("best_of > 1 needs sampling (temperature > 0) or use_beam_search", param="best_of")
        p.copies = n
        return
    k = best_of or n
    if k > MAX_N:
        raise bad_request(f"best_of must be in [1, {MAX_N}], got {k}", param="best_of")
    if k > n:
        if body.stream:
            raise bad_request("best_of > n cannot be streamed", param="best_of")
        p.rank_best_of = True
    if k > 1:
        p.inputs[N.NUM_RETURN_SEQUENCES] = k
