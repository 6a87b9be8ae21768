"""vision: the vision tower + projector on the tiles of every queued request's images, each image at most once.

Thin adapter: backends are `triton_vlm.vision.backends` (`vision_backend`: torch | onnxruntime | tensorrt), the
batching, the family's packing and the embedding cache `triton_vlm.vision.service.VisionService`. A text-only
request carries zero images; a request with bad pixel values or sizes gets its own INVALID_ARG. Embeddings are
cached by the pixels received (no client-sent key is trusted: `image_keys` is not an input). A request
of several rows (a batched ensemble request) is encoded row by row, each row's first `num_images` images; its
`image_embeds` are [B, max images, max T, hidden], zero padded, and `image_feature_lens` [B, max images] the
features of each image.
"""
from triton_vlm.triton import lifeline

lifeline.exit_with_parent()  # first: a stub never outlives its server, even one that dies while we load

from triton_vlm import names as N
from triton_vlm.triton import config, tensors
from triton_vlm.triton.errors import error_response

DEFAULTS = {"vision_device": "", "vision_bits": "32", "projector_device": "", "projector_bits": "32"}


class TritonPythonModel:
    def initialize(self, args):
        with lifeline.loading("vision"):  # a failed load ends this stub, whatever threads it started
            self._load(args)

    def _load(self, args):
        from triton_vlm.triton.vision_metrics import VisionMetrics
        from triton_vlm.vision.service import build

        config.setup_logging()
        p = config.model_parameters(args)
        explicit = {k for k, default in DEFAULTS.items() if (p.get(k) or default) != default}
        self.service = build(config.resolve_model_path(p.get("model_path", "")), p, explicit,
                                     out_dtype=config.output_dtype(args, N.IMAGE_EMBEDS))
        self.metrics = VisionMetrics(self.service)
        lifeline.settle_heap()  # loaded: no full collection walks the import-time heap again

    def execute(self, requests):
        inputs = []  # per request: its rows' VisionInput, or its error
        for r in requests:
            try:
                rows = tensors.batch_size(r, [N.PIXEL_VALUES])
                inputs.append(tensors.per_row(rows, lambda row: _row(r, row)))
            except Exception as e:  # noqa: BLE001 - its own error; the others are unaffected
                inputs.append(e)
        valid = [row for x in inputs if not isinstance(x, Exception) for row in x]
        try:
            encoded = iter(self.service.encode_rows(valid))
        except Exception as e:  # noqa: BLE001 - the encoder failed: every request gets the error
            return [error_response(e) for _ in requests]
        finally:
            self.metrics.update()
        out = []
        for x in inputs:
            results = x if isinstance(x, Exception) else [next(encoded) for _ in x]
            if not isinstance(results, Exception):
                results = next((tensors.in_row(e, i, len(results)) for i, e in enumerate(results)
                                if isinstance(e, Exception)), results)
            out.append(error_response(results) if isinstance(results, Exception) else _response(results))
        return out

    def finalize(self):
        self.metrics.close()
        lifeline.settle_heap()  # the interpreter's exit does not walk the heap (it took 7-10 s)


def _row(request, row):
    """One row's tiles [tiles, 3, H, W], sizes [images, 2] and number of real images."""
    from triton_vlm.vision.service import VisionInput

    return VisionInput(pixels=tensors.input_array(request, N.PIXEL_VALUES, row),
                       sizes=tensors.input_array(request, N.IMAGE_SIZES, row),
                       num_images=tensors.scalar(request, N.spec(N.NUM_IMAGES, N.VISION_INPUTS), row),
                       grids=tensors.input_array(request, N.MEDIA_GRIDS, row))


def _response(results):
    """image_embeds [B, n, T, hidden] (rows padded to one T) and image_feature_lens [B, n]."""
    import torch
    from triton_vlm.vision.service import pad_tokens

    return tensors.torch_outputs({N.IMAGE_EMBEDS: pad_tokens([r.embeds for r in results]),
                                  N.IMAGE_FEATURE_LENS: [torch.tensor(r.lens, dtype=torch.int32)
                                                         for r in results]})

