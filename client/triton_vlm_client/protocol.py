"""The ensemble's wire interface as the client sees it: (name, Triton dtype, dims) of every input it may send
and every output it reads.

This package must not import `triton_vlm` (the server package pulls torch), so the names are repeated here;
`tests/test_names.py` checks them against `triton_vlm.names`. Dims exclude the batch dimension; on the wire
every tensor gets a leading batch dim of 1 (scalars are [1, 1], word lists and images [1, n]).
"""
from __future__ import annotations

from typing import NamedTuple

BYTES, BOOL, INT32, UINT64, FP16, FP32 = "BYTES", "BOOL", "INT32", "UINT64", "FP16", "FP32"

MODEL = "ensemble"

# --- the API key (a server started with --api-key; triton_vlm.server.auth) -------------------------------
API_KEY_ENV = "TRITON_VLM_API_KEY"  # the key VLMClient and the CLI send when none is given
HTTP_AUTH_HEADER = "authorization"  # value "Bearer KEY"
GRPC_AUTH_HEADER = "triton-grpc-protocol-authorization"  # Triton 2.51 reads a restricted API's key here over gRPC


class TensorInfo(NamedTuple):
    name: str
    dtype: str  # Triton client dtype name (BYTES, BOOL, INT32, UINT64, FP32)
    dims: tuple[int, ...]  # without the batch dim; -1 = variable


# --- inputs ---------------------------------------------------------------------------------------------
TEXT_INPUT = "text_input"
IMAGES = "images"
VIDEOS = "videos"
BAD_WORDS = "bad_words"
STOP_WORDS = "stop_words"
MAX_TOKENS = "max_tokens"
BEAM_WIDTH = "beam_width"
NUM_RETURN_SEQUENCES = "num_return_sequences"
LENGTH_PENALTY = "length_penalty"
EARLY_STOPPING = "early_stopping"
MIN_TOKENS = "min_tokens"
MIN_LENGTH = "min_length"  # older name of min_tokens
REPETITION_PENALTY = "repetition_penalty"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
NO_REPEAT_NGRAM_SIZE = "no_repeat_ngram_size"
END_ID = "end_id"
PAD_ID = "pad_id"
TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
SEED = "seed"
RANDOM_SEED = "random_seed"  # older name of seed
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
CACHE_SALT = "cache_salt"
GUIDED_DECODING_GUIDE_TYPE = "guided_decoding_guide_type"  # json, json_schema, regex, ebnf_grammar, ...
GUIDED_DECODING_GUIDE = "guided_decoding_guide"  # the schema / regex / grammar of that type

# --- outputs --------------------------------------------------------------------------------------------
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

# early_stopping on the wire (transformers' False / True / "never")
EARLY_STOPPING_FALSE, EARLY_STOPPING_TRUE, EARLY_STOPPING_NEVER = 0, 1, 2

INPUTS: tuple[TensorInfo, ...] = (
    TensorInfo(TEXT_INPUT, BYTES, (1,)),
    TensorInfo(IMAGES, BYTES, (-1,)),
    TensorInfo(VIDEOS, BYTES, (-1,)),
    TensorInfo(BAD_WORDS, BYTES, (-1,)),
    TensorInfo(STOP_WORDS, BYTES, (-1,)),
    TensorInfo(MAX_TOKENS, INT32, (1,)),
    TensorInfo(BEAM_WIDTH, INT32, (1,)),
    TensorInfo(NUM_RETURN_SEQUENCES, INT32, (1,)),
    TensorInfo(LENGTH_PENALTY, FP32, (1,)),
    TensorInfo(EARLY_STOPPING, INT32, (1,)),
    TensorInfo(MIN_TOKENS, INT32, (1,)),
    TensorInfo(MIN_LENGTH, INT32, (1,)),
    TensorInfo(REPETITION_PENALTY, FP32, (1,)),
    TensorInfo(PRESENCE_PENALTY, FP32, (1,)),
    TensorInfo(FREQUENCY_PENALTY, FP32, (1,)),
    TensorInfo(NO_REPEAT_NGRAM_SIZE, INT32, (1,)),
    TensorInfo(END_ID, INT32, (1,)),
    TensorInfo(PAD_ID, INT32, (1,)),
    TensorInfo(TEMPERATURE, FP32, (1,)),
    TensorInfo(TOP_K, INT32, (1,)),
    TensorInfo(TOP_P, FP32, (1,)),
    TensorInfo(SEED, UINT64, (1,)),
    TensorInfo(RANDOM_SEED, UINT64, (1,)),
    TensorInfo(RETURN_LOG_PROBS, BOOL, (1,)),
    TensorInfo(RETURN_NUM_INPUT_TOKENS, BOOL, (1,)),
    TensorInfo(RETURN_NUM_OUTPUT_TOKENS, BOOL, (1,)),
    TensorInfo(RETURN_TOP_LOG_PROBS, INT32, (1,)),
    TensorInfo(EXCLUDE_INPUT_IN_OUTPUT, BOOL, (1,)),
    TensorInfo(STREAM, BOOL, (1,)),
    TensorInfo(LORA_TASK_ID, UINT64, (1,)),
    TensorInfo(LORA_WEIGHTS, FP16, (-1, -1)),
    TensorInfo(LORA_CONFIG, INT32, (-1, 3)),
    TensorInfo(LORA_NAME, BYTES, (1,)),
    TensorInfo(CACHE_SALT, BYTES, (1,)),
    TensorInfo(GUIDED_DECODING_GUIDE_TYPE, BYTES, (1,)),
    TensorInfo(GUIDED_DECODING_GUIDE, BYTES, (1,)),
)

OUTPUTS: tuple[TensorInfo, ...] = (
    TensorInfo(TEXT_OUTPUT, BYTES, (-1,)),  # one string per sequence (the new piece when streaming)
    TensorInfo(OUTPUT_IDS, INT32, (-1, -1)),  # [sequences, max_len], padded with pad_id
    TensorInfo(SEQUENCE_LENGTH, INT32, (-1,)),  # [sequences]
    TensorInfo(CUM_LOG_PROBS, FP32, (-1,)),  # [sequences]
    TensorInfo(OUTPUT_LOG_PROBS, FP32, (-1, -1)),  # [sequences, new_tokens]
    TensorInfo(BATCH_INDEX, INT32, (1,)),
    TensorInfo(SEQUENCE_INDEX, INT32, (1,)),
    TensorInfo(DROPPED_IMAGES, INT32, (1,)),
    TensorInfo(NUM_INPUT_TOKENS, INT32, (1,)),  # with return_num_input_tokens
    TensorInfo(NUM_OUTPUT_TOKENS, INT32, (1,)),  # with return_num_output_tokens: new tokens in this response
    TensorInfo(NUM_CACHED_TOKENS, INT32, (1,)),  # with return_num_input_tokens: prompt tokens from the prefix cache
    TensorInfo(OUTPUT_TOP_LOG_PROBS, FP32, (-1, -1, -1)),  # [sequences, new_tokens, k] with return_top_log_probs
    TensorInfo(OUTPUT_TOP_LOG_PROB_IDS, INT32, (-1, -1, -1)),  # their token ids
)

INPUTS_BY_NAME: dict[str, TensorInfo] = {t.name: t for t in INPUTS}
OUTPUTS_BY_NAME: dict[str, TensorInfo] = {t.name: t for t in OUTPUTS}

# The generation parameters a caller may pass as keyword arguments (everything but the prompt, the images
# and `stream`, which the client sets itself).
PARAM_NAMES: tuple[str, ...] = tuple(
    t.name for t in INPUTS if t.name not in (TEXT_INPUT, IMAGES, STREAM, LORA_WEIGHTS, LORA_CONFIG))
