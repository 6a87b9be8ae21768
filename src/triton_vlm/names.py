"""Every Triton tensor name of the model repository, declared once.

The ensemble interface follows NVIDIA TensorRT-LLM's ensemble (`text_input`, `max_tokens`, ...), so existing
Triton LLM clients work unchanged; `images` is our addition. Internal tensors connect the ensemble steps
(preprocess -> vision -> llm). `tests/test_names.py` checks every `config.pbtxt` and the client against this
module, so a name or type changes here or nowhere.

Dims exclude the batch dimension (every model has `max_batch_size` > 0).
"""
from __future__ import annotations

from dataclasses import dataclass

# Triton data types as the client names them; `config.pbtxt` uses "TYPE_" + these, except BYTES -> TYPE_STRING.
BYTES, BOOL, INT32, INT64, UINT64, FP16, FP32 = "BYTES", "BOOL", "INT32", "INT64", "UINT64", "FP16", "FP32"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    default: object = None
    doc: str = ""

    @property
    def pbtxt_optional(self) -> bool:
        """`optional: true` in config.pbtxt: every optional input, and the required ones the models check."""
        return self.optional or self.name in MODEL_CHECKED

    @property
    def pbtxt_type(self) -> str:
        return "TYPE_STRING" if self.dtype == BYTES else f"TYPE_{self.dtype}"


def _in(name, dtype, dims=(1,), default=None, doc="", optional=True):
    return TensorSpec(name, dtype, tuple(dims), optional, default, doc)


# --- names (use these constants in code, never string literals) -----------------------------------------
TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
IMAGES = "images"
VIDEOS = "videos"
BEAM_WIDTH = "beam_width"
NUM_RETURN_SEQUENCES = "num_return_sequences"
LENGTH_PENALTY = "length_penalty"
EARLY_STOPPING = "early_stopping"
MIN_TOKENS = "min_tokens"
MIN_LENGTH = "min_length"  # older TensorRT-LLM name of min_tokens
REPETITION_PENALTY = "repetition_penalty"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
NO_REPEAT_NGRAM_SIZE = "no_repeat_ngram_size"
BAD_WORDS = "bad_words"
STOP_WORDS = "stop_words"
END_ID = "end_id"
PAD_ID = "pad_id"
TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
SEED = "seed"
RANDOM_SEED = "random_seed"  # older TensorRT-LLM name of seed
RETURN_LOG_PROBS = "return_log_probs"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
RETURN_TOP_LOG_PROBS = "return_top_log_probs"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
STREAM = "stream"
LORA_TASK_ID = "lora_task_id"
LORA_WEIGHTS = "lora_weights"
LORA_CONFIG = "lora_config"
LORA_NAME = "lora_name"
CACHE_SALT = "cache_salt"  # vLLM's name (no TensorRT-LLM equivalent)
GUIDED_DECODING_GUIDE_TYPE = "guided_decoding_guide_type"  # TensorRT-LLM's ensemble names
GUIDED_DECODING_GUIDE = "guided_decoding_guide"

TEXT_OUTPUT = "text_output"
OUTPUT_IDS = "output_ids"
SEQUENCE_LENGTH = "sequence_length"
CUM_LOG_PROBS = "cum_log_probs"
OUTPUT_LOG_PROBS = "output_log_probs"
BATCH_INDEX = "batch_index"
SEQUENCE_INDEX = "sequence_index"
DROPPED_IMAGES = "dropped_images"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
NUM_CACHED_TOKENS = "num_cached_tokens"
OUTPUT_TOP_LOG_PROBS = "output_top_log_probs"
OUTPUT_TOP_LOG_PROB_IDS = "output_top_log_prob_ids"

# Required inputs that config.pbtxt declares optional and the models check themselves. Triton 2.51 checks only
# the number of inputs: a request that leaves out `text_input` but sends an optional input instead passes, and
# the ensemble, unable to schedule the step that needs it, answers with an empty success and no outputs.
# Declared optional, the request reaches preprocess / llm, which answer INVALID_ARG naming the missing input.
MODEL_CHECKED = frozenset({TEXT_INPUT, MAX_TOKENS})

# internal tensors between ensemble steps
INPUT_IDS = "input_ids"
PIXEL_VALUES = "pixel_values"
IMAGE_EMBEDS = "image_embeds"
NUM_IMAGES = "num_images"
IMAGE_SIZES = "image_sizes"  # (height, width) of each image: its tiles and token count follow from it
IMAGE_FEATURE_LENS = "image_feature_lens"  # features of each image in image_embeds (the rest is padding)
# native-resolution families (Qwen2-VL): each image's or video's patch grid (t, h, w) and a video's seconds per
# temporal patch (0 for an image), in prompt order; zeros for the fixed-tile families
MEDIA_GRIDS = "media_grids"
MEDIA_SECONDS = "media_seconds"
BAD_WORDS_IDS = "bad_words_ids"
STOP_WORDS_IDS = "stop_words_ids"

# A request may stack several prompts (batch dim > 1, as TensorRT-LLM's clients send with `--batch-inputs`): each
# row is answered as its own sequence set, its responses carrying `batch_index` = the row. Between the ensemble
# steps the rows of such a request are padded to a common shape: `input_ids` with INPUT_IDS_PAD, word lists with
# 0 (a zero length ends a list), `image_embeds` / `image_sizes` beyond each row's `num_images`,
# `pixel_values` beyond the row's tiles (one per image for llava-1.5; `layout.tiles(size)` each for LLaVA-NeXT),
# `image_embeds` beyond each image's `image_feature_lens`.
INPUT_IDS_PAD = -1

# early_stopping on the wire (HF's True / False / "never")
EARLY_STOPPING_FALSE, EARLY_STOPPING_TRUE, EARLY_STOPPING_NEVER = 0, 1, 2

# --- the generation parameters, passed unchanged from the ensemble to the llm model ---------------------------
GENERATION_INPUTS: tuple[TensorSpec, ...] = (
    _in(MAX_TOKENS, INT32, optional=False, doc="maximum number of new tokens (required)"),
    _in(BEAM_WIDTH, INT32, default=1, doc="number of beams; 1 = greedy or sampling"),
    _in(NUM_RETURN_SEQUENCES, INT32, default=1, doc="sequences returned, best first; <= beam_width when beam_width > 1"),
    _in(LENGTH_PENALTY, FP32, default=1.0, doc="beam score = sum logprobs / generated_len ** length_penalty"),
    _in(EARLY_STOPPING, INT32, default=EARLY_STOPPING_FALSE,
        doc="beam search stop rule: 0 = False (heuristic), 1 = True, 2 = \"never\""),
    _in(MIN_TOKENS, INT32, default=0, doc="EOS / end_id forbidden before this many new tokens"),
    _in(MIN_LENGTH, INT32, default=0, doc="older name of min_tokens"),
    _in(REPETITION_PENALTY, FP32, default=1.0, doc="CTRL repetition penalty (1.0 = off); sees prompt ids too"),
    _in(PRESENCE_PENALTY, FP32, default=0.0,
        doc="OpenAI's: subtracted from every token generated so far (-2.0..2.0; 0 = off)"),
    _in(FREQUENCY_PENALTY, FP32, default=0.0,
        doc="OpenAI's: subtracted once per time a token was generated so far (-2.0..2.0; 0 = off)"),
    _in(NO_REPEAT_NGRAM_SIZE, INT32, default=0, doc="forbid repeating n-grams of this size (0 = off)"),
    _in(END_ID, INT32, default=None, doc="end-of-sequence id (default: the checkpoint's eos ids)"),
    _in(PAD_ID, INT32, default=-1, doc="fills output_ids after each sequence's end"),
    _in(TEMPERATURE, FP32, default=1.0, doc="sampling temperature; 0 = greedy"),
    _in(TOP_K, INT32, default=0, doc="sampling: keep the k most likely tokens (0 = off)"),
    _in(TOP_P, FP32, default=1.0, doc="sampling: nucleus probability mass (1.0 = off)"),
    _in(SEED, UINT64, default=None, doc="sampling seed (sampling is on when temperature/top_k/top_p are set)"),
    _in(RANDOM_SEED, UINT64, default=None, doc="older name of seed"),
    _in(RETURN_LOG_PROBS, BOOL, default=False, doc="fill cum_log_probs and output_log_probs"),
    _in(RETURN_NUM_INPUT_TOKENS, BOOL, default=False, doc="add num_input_tokens to every response"),
    _in(RETURN_NUM_OUTPUT_TOKENS, BOOL, default=False, doc="add num_output_tokens to every response"),
    _in(RETURN_TOP_LOG_PROBS, INT32, default=0,
        doc="k (0..20): the k most likely tokens and their log probs at each new token (beam_width 1 only)"),
    _in(EXCLUDE_INPUT_IN_OUTPUT, BOOL, default=False, doc="text_output/output_ids hold only new tokens"),
    _in(STREAM, BOOL, default=False, doc="send tokens as they are generated (decoupled responses)"),
)

# --- LoRA: TensorRT-LLM's tensors, plus an adapter of the server's registry by name (preprocess checks them,
# llm resolves them) ------------------------------------------------------------------------------------------
LORA_INPUTS: tuple[TensorSpec, ...] = (
    _in(LORA_TASK_ID, UINT64, default=None, doc="LoRA adapter id; send lora_weights + lora_config with it once"),
    _in(LORA_WEIGHTS, FP16, (-1, -1), doc="[N, W] rows A then scale * B, zero padded (TensorRT-LLM format)"),
    _in(LORA_CONFIG, INT32, (-1, 3), doc="[N, 3] rows [module_id, layer, rank]"),
    _in(LORA_NAME, BYTES, default=None, doc="an adapter of the server's registry (--lora-dir) by name"),
)

# --- prefix-cache isolation (vLLM's `cache_salt`): enters the hash of the prompt's first KV block, so requests
# share cached blocks only with requests of the same salt (llm reads it; the ensemble passes it through) ------
CACHE_INPUTS: tuple[TensorSpec, ...] = (
    _in(CACHE_SALT, BYTES, default=None,
        doc="prefix-cache isolation: cached prompt blocks are shared only between requests of the same salt "
            "(non-empty text, at most 1024 characters)"),
)

# --- grammar-constrained decoding (TensorRT-LLM's ensemble inputs; xgrammar compiles the guide, llm reads them,
# the ensemble passes them through) ---------------------------------------------------------------------------
# guide types: TensorRT-LLM's five, plus vLLM's guided_choice as `choice` (the guide a JSON list of strings)
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag", "choice")
GUIDED_INPUTS: tuple[TensorSpec, ...] = (
    _in(GUIDED_DECODING_GUIDE_TYPE, BYTES, default=None,
        doc="constrain the output: json (any JSON object), json_schema, regex, ebnf_grammar, structural_tag "
            "or choice (a JSON list of strings)"),
    _in(GUIDED_DECODING_GUIDE, BYTES, default=None,
        doc="the schema / regex / grammar / structural tag / choices of guided_decoding_guide_type "
            "(unused for json)"),
)

ENSEMBLE_INPUTS: tuple[TensorSpec, ...] = (
    _in(TEXT_INPUT, BYTES, optional=False,
        doc="prompt; images inline as <img src=\"data:image/...;base64,...\"> or as <image> markers"),
    _in(IMAGES, BYTES, (-1,), doc="encoded image files (or base64 of them), one per <image> marker, in order"),
    _in(VIDEOS, BYTES, (-1,), doc="encoded video files (or base64 of them), one per <video> marker, in order "
                                  "(checkpoints that take videos: Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense and MoE)"),
    _in(BAD_WORDS, BYTES, (-1,), doc="words that are never generated"),
    _in(STOP_WORDS, BYTES, (-1,), doc="words that end a sequence (kept in the output)"),
) + GENERATION_INPUTS + LORA_INPUTS + CACHE_INPUTS + GUIDED_INPUTS

ENSEMBLE_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(TEXT_OUTPUT, BYTES, (-1,), doc="one string per returned sequence (the new piece when streaming)"),
    TensorSpec(OUTPUT_IDS, INT32, (-1, -1), doc="[sequences, max_len] token ids, padded with pad_id"),
    TensorSpec(SEQUENCE_LENGTH, INT32, (-1,), doc="[sequences] valid length of each row of output_ids"),
    TensorSpec(CUM_LOG_PROBS, FP32, (-1,), doc="[sequences] sum of token log probs (beam: the ranking score)"),
    TensorSpec(OUTPUT_LOG_PROBS, FP32, (-1, -1), doc="[sequences, new_tokens] log prob of each new token"),
    TensorSpec(BATCH_INDEX, INT32, (1,), doc="the row of the request this response answers (0 for one prompt)"),
    TensorSpec(SEQUENCE_INDEX, INT32, (1,), doc="which sequence a streamed piece belongs to"),
    TensorSpec(DROPPED_IMAGES, INT32, (1,), doc="images removed by truncation"),
    TensorSpec(NUM_INPUT_TOKENS, INT32, (1,),
               doc="prompt tokens, image tokens included (with return_num_input_tokens)"),
    TensorSpec(NUM_OUTPUT_TOKENS, INT32, (1,),
               doc="new tokens in this response, all its sequences (with return_num_output_tokens)"),
    TensorSpec(OUTPUT_TOP_LOG_PROBS, FP32, (-1, -1, -1),
               doc="[sequences, new_tokens, k] the k highest log probs at each new token, best first "
                   "(with return_top_log_probs)"),
    TensorSpec(OUTPUT_TOP_LOG_PROB_IDS, INT32, (-1, -1, -1),
               doc="[sequences, new_tokens, k] their token ids (with return_top_log_probs)"),
    TensorSpec(NUM_CACHED_TOKENS, INT32, (1,),
               doc="prompt tokens whose KV came from the prefix cache, not computed (with return_num_input_tokens)"),
)

# --- TensorRT-LLM's `llmapi` model (`tensorrt_llm`: the interface that replaced its engine backend in 2026) ---------
IMAGE_URL = "image_url"
STREAMING = "streaming"
SP_BEST_OF = "sampling_param_best_of"
SP_TEMPERATURE = "sampling_param_temperature"
SP_TOP_K = "sampling_param_top_k"
SP_TOP_P = "sampling_param_top_p"
SP_FREQUENCY_PENALTY = "sampling_param_frequency_penalty"
SP_PRESENCE_PENALTY = "sampling_param_presence_penalty"
SP_MAX_TOKENS = "sampling_param_max_tokens"
SP_STOP = "sampling_param_stop"
SP_SEED = "sampling_param_seed"
SP_EXCLUDE_INPUT = "sampling_param_exclude_input_from_output"
SP_RETURN_PERF_METRICS = "sampling_param_return_perf_metrics"
RETURN_FINISH_REASON = "return_finish_reason"
RETURN_STOP_REASON = "return_stop_reason"
RETURN_CUMULATIVE_LOGPROB = "return_cumulative_logprob"
STOP_REQUEST = "stop"  # true: cancel the running request with this request's id
LORA_ID = "lora_id"
LORA_PATH = "lora_path"
LORA_CKPT_SOURCE = "lora_ckpt_source"

FINISH_REASON = "finish_reason"
STOP_REASON = "stop_reason"
CUMULATIVE_LOGPROB = "cumulative_logprob"
KV_CACHE_REUSED_BLOCK = "kv_cache_reused_block"
KV_CACHE_MISSED_BLOCK = "kv_cache_missed_block"
KV_CACHE_ALLOC_NEW_BLOCKS = "kv_cache_alloc_new_blocks"
KV_CACHE_ALLOC_TOTAL_BLOCKS = "kv_cache_alloc_total_blocks"
KV_CACHE_HIT_RATE = "kv_cache_hit_rate"
ARRIVAL_TIME_NS = "arrival_time_ns"
FIRST_SCHEDULED_TIME_NS = "first_scheduled_time_ns"
FIRST_TOKEN_TIME_NS = "first_token_time_ns"
LAST_TOKEN_TIME_NS = "last_token_time_ns"
ACCEPTANCE_RATE = "acceptance_rate"
TOTAL_ACCEPTED_DRAFT_TOKENS = "total_accepted_draft_tokens"
TOTAL_DRAFT_TOKENS = "total_draft_tokens"

LLMAPI_INPUTS: tuple[TensorSpec, ...] = (
    _in(TEXT_INPUT, BYTES, (-1,), optional=False, doc="the prompt (one); <image> markers place the images, else "
                                                      "one marker per image_url is put before the text"),
    _in(IMAGE_URL, BYTES, (-1,), doc="one per image: data: URIs, or http(s) URLs of allowed hosts (local paths "
                                     "and file:// refused)"),
    _in(STREAMING, BOOL, default=False, doc="stream the new text of each step (decoupled responses)"),
    _in(SP_BEST_OF, INT32, default=1, doc="greedy: beam search of this width, the best beam returned; sampling: "
                                          "this many samples, the one of highest cumulative log prob returned"),
    _in(SP_TEMPERATURE, FP32, default=None, doc="sampling temperature (none of temperature/top_k/top_p: greedy)"),
    _in(SP_TOP_K, INT32, default=None, doc="sampling: keep the k most likely tokens (1 = greedy)"),
    _in(SP_TOP_P, FP32, default=None, doc="sampling: nucleus probability mass"),
    _in(SP_FREQUENCY_PENALTY, FP32, default=0.0, doc="OpenAI's frequency penalty (-2.0..2.0)"),
    _in(SP_PRESENCE_PENALTY, FP32, default=0.0, doc="OpenAI's presence penalty (-2.0..2.0)"),
    _in(SP_MAX_TOKENS, INT32, default=32, doc="maximum new tokens (TensorRT-LLM's SamplingParams default 32)"),
    _in(SP_STOP, BYTES, (-1,), doc="stop strings: a sequence ends with the first one it generates (kept in "
                                   "the text, named by stop_reason)"),
    _in(SP_SEED, UINT64, default=None, doc="sampling seed"),
    _in(SP_EXCLUDE_INPUT, BOOL, default=False, doc="text_output without the prompt (default: with it, as "
                                                   "TensorRT-LLM's model; streamed responses never repeat it)"),
    _in(SP_RETURN_PERF_METRICS, BOOL, default=False, doc="add the kv_cache_* and *_time_ns outputs"),
    _in(RETURN_FINISH_REASON, BOOL, default=False, doc="add finish_reason"),
    _in(RETURN_STOP_REASON, BOOL, default=False, doc="add stop_reason"),
    _in(RETURN_CUMULATIVE_LOGPROB, BOOL, default=False, doc="add cumulative_logprob"),
    _in(STOP_REQUEST, BOOL, default=False, doc="cancel the running request of the same request id"),
    _in(LORA_ID, UINT64, default=None, doc="the adapter's cache key (with lora_path)"),
    _in(LORA_NAME, BYTES, default=None, doc="with lora_path: a label; alone: an adapter of the registry by name"),
    _in(LORA_PATH, BYTES, default=None, doc="a PEFT adapter folder under one of the server's lora_root folders"),
    _in(LORA_CKPT_SOURCE, BYTES, default="hf", doc="the adapter's format: hf (PEFT) only"),
)
PERF_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(KV_CACHE_REUSED_BLOCK, INT32, (-1,), doc="prompt KV blocks found in the prefix cache"),
    TensorSpec(KV_CACHE_MISSED_BLOCK, INT32, (-1,), doc="prompt KV blocks not found (computed)"),
    TensorSpec(KV_CACHE_ALLOC_NEW_BLOCKS, INT32, (-1,), doc="KV blocks newly allocated for the request"),
    TensorSpec(KV_CACHE_ALLOC_TOTAL_BLOCKS, INT32, (-1,), doc="KV blocks the request held (reused + new)"),
    TensorSpec(KV_CACHE_HIT_RATE, FP32, (-1,), doc="reused / (reused + missed)"),
    TensorSpec(ARRIVAL_TIME_NS, INT64, (1,), doc="the engine received the request (ns since the epoch)"),
    TensorSpec(FIRST_SCHEDULED_TIME_NS, INT64, (1,), doc="first admitted to a batch (ns since the epoch)"),
    TensorSpec(FIRST_TOKEN_TIME_NS, INT64, (1,), doc="first new token (ns since the epoch)"),
    TensorSpec(LAST_TOKEN_TIME_NS, INT64, (1,), doc="last new token (ns since the epoch)"),
    TensorSpec(ACCEPTANCE_RATE, FP32, (1,), doc="speculative decoding: 0 (none yet)"),
    TensorSpec(TOTAL_ACCEPTED_DRAFT_TOKENS, INT32, (1,), doc="speculative decoding: 0 (none yet)"),
    TensorSpec(TOTAL_DRAFT_TOKENS, INT32, (1,), doc="speculative decoding: 0 (none yet)"),
)
LLMAPI_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(TEXT_OUTPUT, BYTES, (-1,), doc="the text (streaming: the new piece)"),
    TensorSpec(FINISH_REASON, BYTES, (-1,), doc="stop, length or cancelled (with return_finish_reason)"),
    TensorSpec(STOP_REASON, BYTES, (-1,), doc="the stop string that ended it, else None (with return_stop_reason)"),
    TensorSpec(CUMULATIVE_LOGPROB, FP32, (-1,), doc="sum of the token log probs (with return_cumulative_logprob)"),
) + PERF_OUTPUTS

# --- per model ------------------------------------------------------------------------------------------
PREPROCESS_INPUTS: tuple[TensorSpec, ...] = (
    _in(TEXT_INPUT, BYTES, optional=False),
    _in(IMAGES, BYTES, (-1,)),
    _in(VIDEOS, BYTES, (-1,)),
    _in(MAX_TOKENS, INT32, optional=False),
    _in(BAD_WORDS, BYTES, (-1,)),
    _in(STOP_WORDS, BYTES, (-1,)),
) + LORA_INPUTS  # checked here (a bad adapter is refused before any image is encoded), used by llm
PREPROCESS_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(INPUT_IDS, INT32, (-1,)),  # prompt ids with N placeholder ids per image
    TensorSpec(PIXEL_VALUES, FP32, (-1, 3, -1, -1)),  # [tiles, 3, H, W], processor-normalised, images in order
    TensorSpec(BAD_WORDS_IDS, INT32, (-1,)),  # length-prefixed id lists, see params.words_to_flat
    TensorSpec(STOP_WORDS_IDS, INT32, (-1,)),
    TensorSpec(DROPPED_IMAGES, INT32, (1,)),
    TensorSpec(NUM_IMAGES, INT32, (1,)),  # images of the row (pixel_values / image_sizes are padded beyond it)
    TensorSpec(IMAGE_SIZES, INT32, (-1, 2)),  # [images, 2] (height, width) of each kept image (a video's frames)
    TensorSpec(MEDIA_GRIDS, INT32, (-1, 3)),  # [images, 3] (t, h, w) patches (native resolution; else zeros)
    TensorSpec(MEDIA_SECONDS, FP32, (-1,)),  # [images] a video's seconds per temporal patch, 0 for an image
)
VISION_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(PIXEL_VALUES, FP32, (-1, 3, -1, -1)),
    _in(NUM_IMAGES, INT32),  # optional: without it every image of pixel_values is real
    _in(IMAGE_SIZES, INT32, (-1, 2)),  # optional for llava-1.5 (one tile per image), required for LLaVA-NeXT
    _in(MEDIA_GRIDS, INT32, (-1, 3)),  # optional: native resolution (Qwen2-VL); without it grids follow the sizes
)
VISION_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(IMAGE_EMBEDS, FP32, (-1, -1, -1)),  # [images, T, hidden], each image zero padded to the longest
    TensorSpec(IMAGE_FEATURE_LENS, INT32, (-1,)),  # [images] features of each image
)
LLM_INPUTS: tuple[TensorSpec, ...] = (
    _in(INPUT_IDS, INT32, (-1,), optional=False),
    _in(IMAGE_EMBEDS, FP32, (-1, -1, -1)),
    _in(BAD_WORDS_IDS, INT32, (-1,)),
    _in(STOP_WORDS_IDS, INT32, (-1,)),
    _in(DROPPED_IMAGES, INT32),
    _in(NUM_IMAGES, INT32),  # optional: without it every image of image_embeds is real
    _in(IMAGE_FEATURE_LENS, INT32, (-1,)),  # optional: without it every image fills image_embeds' T
    _in(IMAGE_SIZES, INT32, (-1, 2)),  # optional; M-RoPE checkpoints (Qwen2-VL): each image's grid follows from it
    _in(MEDIA_GRIDS, INT32, (-1, 3)),  # optional; M-RoPE: each image's / video's grid (else from image_sizes)
    _in(MEDIA_SECONDS, FP32, (-1,)),  # optional; Qwen2.5-VL's video time positions
) + GENERATION_INPUTS + LORA_INPUTS + CACHE_INPUTS + GUIDED_INPUTS + (
    _in(LORA_PATH, BYTES),  # optional; a PEFT folder under lora_root, cached under lora_task_id (tensorrt_llm's)
    _in(STOP_REQUEST, BOOL),  # optional; true: cancel the running request of this request's id (tensorrt_llm's)
)
# llm inputs the ensemble does not wire: only the tensorrt_llm model sends them
NOT_IN_ENSEMBLE = frozenset({LORA_PATH, STOP_REQUEST})
LLM_OUTPUTS: tuple[TensorSpec, ...] = ENSEMBLE_OUTPUTS + PERF_OUTPUTS  # the perf ones on final responses only

MODELS: dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]] = {
    "ensemble": (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS),
    "preprocess": (PREPROCESS_INPUTS, PREPROCESS_OUTPUTS),
    "vision": (VISION_INPUTS, VISION_OUTPUTS),
    "llm": (LLM_INPUTS, LLM_OUTPUTS),
    "tensorrt_llm": (LLMAPI_INPUTS, LLMAPI_OUTPUTS),
}


# The pipeline, described once: the ensemble's steps in order. A step's input takes the output of the same name of
# the nearest earlier step that has one (an internal tensor, `_<name>` in the ensemble config), else the ensemble's
# input of that name. The ensemble config follows it (tests/test_names.py) and so does the OpenAI front end's direct
# route (`openai/triton.py`, which runs the steps itself).
PIPELINE: tuple[str, ...] = ("preprocess", "vision", "llm")


def fed_by(model: str, earlier: str) -> frozenset[str]:
    """The inputs of `model` that the step `earlier` feeds (its outputs of those names, unless a step between
    them produces the same name)."""
    steps = PIPELINE[PIPELINE.index(earlier):PIPELINE.index(model)]
    wanted = {s.name for s in MODELS[model][0]}
    later = set().union(*({s.name for s in MODELS[m][1]} for m in steps[1:]))
    return frozenset(wanted & {s.name for s in MODELS[earlier][1]} - later)


def spec(name: str, specs: tuple[TensorSpec, ...] = ENSEMBLE_INPUTS + ENSEMBLE_OUTPUTS) -> TensorSpec:
    for s in specs:
        if s.name == name:
            return s
    raise KeyError(name)
