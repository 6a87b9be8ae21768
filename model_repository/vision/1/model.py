"""vision: the vision tower + projector on the images of every queued request, each image at most once.

Thin adapter: backends are `triton_vlm.vision.backends` (`vision_backend`: torch | onnxruntime | tensorrt), the
batching and the embedding cache `triton_vlm.vision.batch.VisionService`. A text-only request carries zero
images; a request with bad pixel values or keys gets its own INVALID_ARG.
"""
from triton_vlm.triton import lifeline

lifeline.exit_with_parent()  # first: a stub never outlives its server, even one that dies while we load

from triton_vlm import names as N
from triton_vlm.triton import config, tensors
from triton_vlm.triton.errors import error_response

DEFAULTS = {"vision_device": "", "vision_bits": "32", "projector_device": "", "projector_bits": "32"}


class TritonPythonModel:
    def initialize(self, args):
        from triton_vlm.triton.vision_metrics import VisionMetrics
        from triton_vlm.vision.service import build

        config.setup_logging()
        p = config.model_parameters(args)
        explicit = {k for k, default in DEFAULTS.items() if (p.get(k) or default) != default}
        self.service = build(config.resolve_model_path(p.get("model_path", "")), p, explicit,
                                     out_dtype=config.output_dtype(args, N.IMAGE_EMBEDS))
        self.metrics = VisionMetrics(self.service)

    def execute(self, requests):
        inputs = []
        for r in requests:
            try:
                inputs.append((tensors.input_array(r, N.PIXEL_VALUES), tensors.strings(r, N.IMAGE_KEYS) or None))
            except Exception as e:  # noqa: BLE001 - its own error; the others are unaffected
                inputs.append(e)
        valid = [x for x in inputs if not isinstance(x, Exception)]
        try:
            encoded = iter(self.service.encode(valid))
        except Exception as e:  # noqa: BLE001 - the encoder failed: every request gets the error
            return [error_response(e) for _ in requests]
        finally:
            self.metrics.update()
        out = []
        for x in inputs:
            result = x if isinstance(x, Exception) else next(encoded)
            out.append(error_response(result) if isinstance(result, Exception)
                       else tensors.torch_response(N.IMAGE_EMBEDS, result))  # [n, T, hidden]
        return out

    def finalize(self):
        self.metrics.close()
