"""Request bodies of the OpenAI API as pydantic models: the one place a request's shape and types are checked.

Field names are OpenAI's, plus vLLM's extra sampling parameters with vLLM's names (`top_k`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `use_beam_search`, `length_penalty`, `early_stopping`, ...). A field we do
not know is refused (400 "unrecognized request argument", as OpenAI answers); fields OpenAI defines that would
change the answer but that we do not have (`tools`, `response_format`, ...) are accepted by the parser and
refused by `unsupported_fields` with a 400 that names them; bookkeeping fields (`user`, `metadata`, ...) are
accepted and ignored. Responses are built as plain dicts (`responses.py`): cheaper than models on the hot path.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # choices per request: the engine's most returned sequences (params.MAX_BEAM_WIDTH)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit

# Fields OpenAI defines that change what is generated and that this server does not have: a 400 names them
# when set to anything but their "off" value.
UNSUPPORTED_CHAT = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
                    "audio", "modalities", "prediction", "web_search_options", "reasoning_effort",
                    "parallel_tool_calls")
UNSUPPORTED_COMPLETION = ("suffix", "logit_bias")
_OFF = (None, False, {}, [], ["text"], "none")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class ImageURL(_Strict):
    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None  # accepted; the checkpoint's processor decides


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None  # accepted and ignored, as by templates that do not use it
    tool_calls: Optional[Any] = None  # refused when set (no tools)
    refusal: Optional[str] = None


class _Sampling(_Strict):
    """Parameters shared by chat and completions."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's extra parameters (sent by the openai client through `extra_body`)
    top_k: Optional[int] = None
    min_tokens: int = 0
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    use_beam_search: bool = False
    best_of: Optional[int] = None
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    cache_salt: Optional[str] = None  # vLLM's prefix-cache isolation (params.cache_salt)
    # bookkeeping fields: accepted, ignored (`prompt_cache_key` is OpenAI's routing hint for its cache, not an
    # isolation key: one engine has nothing to route, and hits depend on the prefix and the salt only)
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    request_id: Optional[str] = None  # vLLM's: our id for this request (logs, Triton's request id)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    verbosity: Optional[str] = None
    # vLLM's chat-template controls
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # known, not supported (refused by unsupported_fields when set)
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    response_format: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None

    @property
    def max_new_tokens(self) -> Optional[int]:
        """`max_completion_tokens` wins over the deprecated `max_tokens`, as OpenAI reads them."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens


def unsupported_fields(body: BaseModel, names: tuple[str, ...]) -> list[str]:
    """The fields of `names` the request set to something other than their "off" value."""
    out = []
    for name in names:
        value = getattr(body, name, None)
        if name == "parallel_tool_calls" and value is not None:
            continue  # meaningless without tools; the openai client may send it
        if value not in _OFF:
            out.append(name)
    return out
