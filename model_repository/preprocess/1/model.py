"""preprocess: prompt + images -> input ids with image placeholders, pixel values, word lists.

Thin adapter: the logic is `triton_vlm.preprocess.service.Preprocessor`. A request of several rows (prompts) is
preprocessed row by row (a bad row refuses the request, naming the row); the outputs are padded to one shape
(`preprocess.stack_rows`). In a row of a batched request, empty `images` entries are padding (rows with fewer
images than others).
"""
from triton_vlm.triton import lifeline

lifeline.exit_with_parent()  # first: a stub never outlives its server, even one that dies while we load

from triton_vlm import names as N
from triton_vlm.triton import config, tensors
from triton_vlm.triton.errors import error_response

_OUT = {s.name: s for s in N.PREPROCESS_OUTPUTS}
_IN = {s.name: s for s in N.PREPROCESS_INPUTS}


class TritonPythonModel:
    def initialize(self, args):
        with lifeline.loading("preprocess"):  # a failed load ends this stub, whatever threads it started
            self._load(args)

    def _load(self, args):
        from triton_vlm.params import DEFAULT_MAX_MEDIA_BYTES, DEFAULT_MAX_MEDIA_TOKENS
        from triton_vlm.preprocess.service import Preprocessor
        from triton_vlm.server import front_half

        config.setup_logging()
        p = config.model_parameters(args)
        self.pre = Preprocessor(
            config.resolve_model_path(p.get("model_path", "")),
            max_images=config.parse_int(p, "max_images", 8),
            max_pixels=config.parse_int(p, "max_image_pixels", 4096 * 4096),
            context_length=config.parse_int(p, "context_length", 0) or None,
            image_start=p.get("image_start", ""),
            image_end=p.get("image_end", ""),
            image_cache_size=config.parse_int(p, "image_cache_size", 64),
            max_text_chars=config.parse_int(p, "max_text_chars", 0),
            max_videos=config.parse_int(p, "max_videos", 2),
            max_media_tokens=config.parse_int(p, "max_media_tokens", 0) or DEFAULT_MAX_MEDIA_TOKENS,
            max_media_bytes=config.parse_int(p, "max_media_bytes", 0) or DEFAULT_MAX_MEDIA_BYTES,
            # the launcher writes its rule's count; "0" (this repository served as is): the rule, llm on a GPU
            decode_threads=(config.parse_int(p, "decode_threads", 0)
                            or front_half.plan(front_half.usable_cpus()).decode_threads),
        )
        self.lora = _LoraCheck(self.pre.info.model_dir, p.get("lora_dir") or None,
                               config.parse_int(p, "max_lora_rank", 64))
        lifeline.settle_heap()  # loaded: no full collection walks the import-time heap again

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def finalize(self):
        self.pre.pool.close()
        lifeline.settle_heap()  # the interpreter's exit does not walk the heap (it took 7-10 s)

    def _one(self, request):
        from triton_vlm.preprocess.service import stack_rows

        try:
            rows = tensors.batch_size(request, _IN)
            results = tensors.per_row(rows, lambda row: self._row(request, row))
            out = stack_rows(results)  # every output with the batch dim, e.g. pixel_values [B, images, 3, H, W]
            return tensors.batch_response({name: (_OUT[name], value) for name, value in out.items()})
        except Exception as e:  # noqa: BLE001 - each request gets its own error; the others are unaffected
            return error_response(e)

    def _row(self, request, row):
        self.lora(request, row)
        images = tensors.blobs(request, N.IMAGES, row)
        videos = tensors.blobs(request, N.VIDEOS, row)
        if row is not None:
            for media in (images, videos):
                while media and not media[-1]:  # padding of a row with fewer images than the others
                    media.pop()
        return self.pre(
            tensors.scalar(request, _IN[N.TEXT_INPUT], row),
            images,
            tensors.scalar(request, _IN[N.MAX_TOKENS], row),
            tensors.strings(request, N.BAD_WORDS, row),
            tensors.strings(request, N.STOP_WORDS, row),
            videos,
        )


class _LoraCheck:
    """Refuses bad LoRA inputs (`lora.request.check_request`: the wire weights are checked in place, no adapter
    is built) before the images are decoded and encoded."""

    def __init__(self, model_dir, lora_dir, max_rank: int):
        from triton_vlm.lora.registry import Registry
        from triton_vlm.spec import CheckpointSpec

        self.spec = CheckpointSpec.load(model_dir).text
        self.registry, self.max_rank = Registry(lora_dir, self.spec), max_rank

    def __call__(self, request, row=None) -> None:
        from triton_vlm.lora.request import check_request

        inputs = tensors.lora_inputs(request, row)
        if inputs is not None:
            check_request(*inputs, self.spec, self.registry, self.max_rank)
