"""Request bodies of the OpenAI API as pydantic models: the one place a request's shape and types are checked.

Field names are OpenAI's, plus vLLM's extra sampling parameters with vLLM's names (`top_k`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `use_beam_search`, `length_penalty`, `early_stopping`, ...). A field we do
not know is refused (400 "unrecognized request argument", as OpenAI answers); fields OpenAI defines that would
change the answer but that we do not have (`functions`, `logit_bias`, ...) are accepted by the parser and
refused by `unsupported_fields` with a 400 that names them; structured outputs (`response_format`, vLLM's
`structured_outputs` and `guided_*`) and `tools` are checked here and mapped by `structured.py` / `tools.py`;
bookkeeping fields (`user`, `metadata`, ...) are accepted and ignored. Responses are built as plain dicts
(`responses.py`): cheaper than models on the hot path.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # choices per request: the engine's most returned sequences (params.MAX_BEAM_WIDTH)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit

# Fields OpenAI defines that change what is generated and that this server does not have: a 400 names them
# when set to anything but their "off" value.
UNSUPPORTED_CHAT = ("functions", "function_call", "logit_bias", "audio", "modalities", "prediction",
                    "web_search_options", "reasoning_effort")
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


class VideoURL(_Strict):
    url: str  # a data:video/<type>;base64, URL (vLLM's form)


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[Union[TextPart, ImagePart, VideoPart], Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: Union[str, dict[str, Any]]  # OpenAI sends a JSON string; HF templates want the object


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None  # accepted and ignored, as by templates that do not use it
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls (rendered by the template)
    tool_call_id: Optional[str] = None  # a tool message: the call it answers
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None  # an earlier answer sent back as it came: accepted, ignored


# --- structured outputs and tools (mapped to the ensemble's guided_decoding inputs by structured.py) -----
class JSONSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Union[dict[str, Any], bool, None] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # accepted: the schema is always enforced


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


class StructuralTagFormat(BaseModel):
    """vLLM's / xgrammar's structural tag (its fields are the library's to check)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["structural_tag"]


ResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaResponseFormat, StructuralTagFormat],
                           Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""
    json_: Union[str, dict[str, Any], bool, None] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; none: an object without properties
    strict: Optional[bool] = None  # accepted: named and required calls are always constrained


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Structured(_Strict):
    """Structured-output fields of both endpoints (OpenAI's `response_format`, vLLM's extras)."""
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Union[str, dict[str, Any], bool, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class _Sampling(_Structured):
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
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None  # accepted (named and required choices make one call)
    # known, not supported (refused by unsupported_fields when set)
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[str] = None

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
        if value not in _OFF:
            out.append(name)
    return out
