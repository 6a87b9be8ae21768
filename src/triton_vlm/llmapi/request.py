"""One `tensorrt_llm` request (TensorRT-LLM's `llmapi` Triton model's tensors) -> what the ensemble's pipeline takes.

The mapping (TensorRT-LLM's `SamplingParams` defaults and meaning; docs/interfaces.md has the table):
- `sampling_param_max_tokens`: default 32 (SamplingParams' default);
- none of `temperature` / `top_k` / `top_p`: greedy; temperature 0 or top_k 1: greedy too (as both servers read
  them); the penalties are OpenAI's (-2.0..2.0, refused outside: the ensemble's range);
- `sampling_param_best_of` k (default 1): greedy -> beam search of width k returning the best beam (TensorRT-LLM's
  `use_beam_search` meaning, the only way best-of applies without sampling); sampling -> k samples, the one of
  highest cumulative log prob returned (SamplingParams' `best_of` > `n`). Sampled best-of cannot stream (the best
  is known only at the end): refused with `streaming`;
- `sampling_param_stop`: stop strings, tokenized by preprocess as the ensemble's `stop_words` (a sequence ends on
  the first it generates; the string stays in the text, `stop_reason` names it);
- `sampling_param_exclude_input_from_output`: default False (the model's default), as the ensemble's
  `exclude_input_in_output`: the non-streamed text starts with the prompt; streamed responses never repeat it;
- LoRA: `lora_path` (+ `lora_id`, the cache key; `lora_name` then only a label) or `lora_name` alone (an adapter of
  the registry, as the ensemble's `lora_name`); `lora_ckpt_source` "hf" only.
Every refusal is InvalidArgument naming the input, the value and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .. import names as N
from ..errors import InvalidArgument
from ..lora.paths import check_ckpt_source
from ..params import MAX_BEAM_WIDTH

DEFAULT_MAX_TOKENS = 32  # TensorRT-LLM's SamplingParams.max_tokens
_URL_SCHEMES = ("data:", "http://", "https://")


@dataclass
class LoraChoice:
    lora_id: Optional[int] = None
    name: Optional[str] = None
    path: Optional[str] = None


@dataclass
class LlmapiRequest:
    prompt: str
    image_urls: list[str] = field(default_factory=list)
    streaming: bool = False
    generation: dict[str, Any] = field(default_factory=dict)  # ensemble generation input -> value
    stop: list[str] = field(default_factory=list)
    best_of_samples: int = 1  # > 1: that many samples, the best returned
    lora: Optional[LoraChoice] = None
    return_finish_reason: bool = False
    return_stop_reason: bool = False
    return_cumulative_logprob: bool = False
    return_perf_metrics: bool = False

    @property
    def max_tokens(self) -> int:
        return int(self.generation[N.MAX_TOKENS])

    @property
    def exclude_input(self) -> bool:
        return bool(self.generation[N.EXCLUDE_INPUT_IN_OUTPUT])


def _sampling(values: Mapping[str, Any]) -> bool:
    t, k = values.get(N.SP_TEMPERATURE), values.get(N.SP_TOP_K)
    asked = any(values.get(n) is not None for n in (N.SP_TEMPERATURE, N.SP_TOP_K, N.SP_TOP_P))
    return asked and (t is None or t > 0) and k != 1


def _generation(values: Mapping[str, Any], streaming: bool, exclude: bool) -> tuple[dict[str, Any], int]:
    """The ensemble's generation inputs, and the samples of a sampled best-of (1: none)."""
    gen: dict[str, Any] = {N.MAX_TOKENS: DEFAULT_MAX_TOKENS if values.get(N.SP_MAX_TOKENS) is None
                           else int(values[N.SP_MAX_TOKENS]),
                           N.EXCLUDE_INPUT_IN_OUTPUT: exclude, N.STREAM: streaming}
    for ours, theirs in ((N.TEMPERATURE, N.SP_TEMPERATURE), (N.TOP_K, N.SP_TOP_K), (N.TOP_P, N.SP_TOP_P),
                         (N.FREQUENCY_PENALTY, N.SP_FREQUENCY_PENALTY), (N.PRESENCE_PENALTY, N.SP_PRESENCE_PENALTY),
                         (N.SEED, N.SP_SEED)):
        if values.get(theirs) is not None:
            gen[ours] = values[theirs]
    best_of = 1 if values.get(N.SP_BEST_OF) is None else int(values[N.SP_BEST_OF])
    if not 1 <= best_of <= MAX_BEAM_WIDTH:
        raise InvalidArgument(f"{N.SP_BEST_OF} must be in [1, {MAX_BEAM_WIDTH}], got {best_of}")
    if best_of == 1:
        return gen, 1
    if not _sampling(values):  # greedy: a beam search of width best_of, the best beam returned
        gen[N.BEAM_WIDTH], gen[N.NUM_RETURN_SEQUENCES] = best_of, 1
        return gen, 1
    if streaming:
        raise InvalidArgument(f"{N.SP_BEST_OF} {best_of} with sampling cannot stream (the best of the samples is "
                              "known only when all are done); send streaming false, or best_of 1")
    gen[N.NUM_RETURN_SEQUENCES] = best_of
    return gen, best_of


def _image_urls(urls: list[str]) -> list[str]:
    for i, u in enumerate(urls):
        if not u.lower().startswith(_URL_SCHEMES):
            kind = "file:// URLs" if u.lower().startswith("file:") else "local paths and other schemes"
            raise InvalidArgument(f"{N.IMAGE_URL}[{i}] {u[:80]!r}: {kind} are refused; send a data: URI or an "
                                  "http(s) URL")
    return urls


def _lora(values: Mapping[str, Any]) -> Optional[LoraChoice]:
    lora_id, name, path = values.get(N.LORA_ID), values.get(N.LORA_NAME) or None, values.get(N.LORA_PATH) or None
    check_ckpt_source(values.get(N.LORA_CKPT_SOURCE))
    if lora_id is None and name is None and path is None:
        return None
    if path is not None and lora_id is None:
        raise InvalidArgument(f"{N.LORA_PATH} {path!r} needs a {N.LORA_ID} to cache the adapter under")
    if path is None and name is None:
        raise InvalidArgument(f"{N.LORA_ID} {lora_id} needs {N.LORA_PATH} (an adapter folder) or {N.LORA_NAME} "
                              "(an adapter of the registry)")
    return LoraChoice(None if lora_id is None else int(lora_id), name, path)


def parse(values: Mapping[str, Any], prompts: list[str], image_urls: list[str],
          stop: list[str]) -> LlmapiRequest:
    """`values`: scalar input name -> Python value (absent ones missing); the list inputs apart."""
    if len(prompts) != 1:
        raise InvalidArgument(f"{N.TEXT_INPUT} must hold exactly one prompt, got {len(prompts)}")
    if not prompts[0].strip():
        raise InvalidArgument(f"{N.TEXT_INPUT} is empty: send a non-empty prompt")
    if any(not s for s in stop):
        raise InvalidArgument(f"{N.SP_STOP} holds an empty string; every stop string needs at least one character")
    streaming = bool(values.get(N.STREAMING, False))
    exclude = bool(values.get(N.SP_EXCLUDE_INPUT, False))
    gen, samples = _generation(values, streaming, exclude)
    return LlmapiRequest(
        prompt=prompts[0], image_urls=_image_urls(image_urls), streaming=streaming, generation=gen,
        stop=list(stop), best_of_samples=samples, lora=_lora(values),
        return_finish_reason=bool(values.get(N.RETURN_FINISH_REASON, False)),
        return_stop_reason=bool(values.get(N.RETURN_STOP_REASON, False)),
        return_cumulative_logprob=bool(values.get(N.RETURN_CUMULATIVE_LOGPROB, False)),
        return_perf_metrics=bool(values.get(N.SP_RETURN_PERF_METRICS, False)))


def with_markers(prompt: str, n_images: int, markers: tuple[str, ...]) -> str:
    """The prompt with one image marker per image: unchanged when it has markers, else one `<image>` line per
    image before the text (TensorRT-LLM's multimodal loader puts the images before the text)."""
    if n_images == 0 or any(m and m in prompt for m in markers):
        return prompt
    return f"{markers[0]}\n" * n_images + prompt
