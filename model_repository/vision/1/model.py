"""vision: the vision tower + projector on all images of all requests in one forward.

Thin adapter: the batching is `triton_vlm.vision.encode_batch` (ragged image counts; a text-only request
carries zero images; a request with bad pixel values gets its own INVALID_ARG).
"""
from triton_vlm.triton import lifeline

lifeline.exit_with_parent()  # first: a stub never outlives its server, even one that dies while we load

from triton_vlm import names as N
from triton_vlm.triton import config, tensors
from triton_vlm.triton.errors import error_response

_OUT = {s.name: s for s in N.VISION_OUTPUTS}


class TritonPythonModel:
    def initialize(self, args):
        from triton_vlm.vision import VisionEncoder, VisionSettings

        config.setup_logging()
        p = config.model_parameters(args)
        device = p.get("device") or "cpu"
        self.encoder = VisionEncoder(config.resolve_model_path(p.get("model_path", "")), VisionSettings(
            vision_device=p.get("vision_device") or device,
            vision_bits=p.get("vision_bits") or 32,
            projector_device=p.get("projector_device") or device,
            projector_bits=p.get("projector_bits") or 32,
            pipeline=p.get("pipeline") or "auto",
        ))
        self.chunk = config.parse_int(p, "max_images_per_forward", 32)

    def execute(self, requests):
        from triton_vlm.vision import encode_batch

        inputs = []
        for r in requests:
            try:
                inputs.append(tensors.input_array(r, N.PIXEL_VALUES))  # [images, 3, H, W] or None
            except Exception as e:  # noqa: BLE001 - its own error; the others are unaffected
                inputs.append(e)
        valid = [x for x in inputs if not isinstance(x, Exception)]
        try:
            encoded = iter(encode_batch(self.encoder, valid, self.chunk))
        except Exception as e:  # noqa: BLE001 - the forward failed: every request gets the error
            return [error_response(e) for _ in requests]
        out = []
        for x in inputs:
            result = x if isinstance(x, Exception) else next(encoded)
            if isinstance(result, Exception):
                out.append(error_response(result))
            else:  # [n, T, hidden]
                out.append(tensors.response({N.IMAGE_EMBEDS: (_OUT[N.IMAGE_EMBEDS], result)}))
        return out
