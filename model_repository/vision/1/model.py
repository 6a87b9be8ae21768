"""vision: the vision tower + projector on all images of all requests in one forward.

Requests arrive together through dynamic batching with ragged image counts (a text-only request carries zero
images); their pixel values are concatenated, encoded in chunks of `max_images_per_forward`, and split back.
"""
from triton_vlm.triton import lifeline

lifeline.exit_with_parent()  # first: a stub never outlives its server, even one that dies while we load

import numpy as np

from triton_vlm import names as N
from triton_vlm.triton import config, tensors
from triton_vlm.triton.errors import error_response
from triton_vlm.vision import check_pixel_values

_OUT = {s.name: s for s in N.VISION_OUTPUTS}


class TritonPythonModel:
    def initialize(self, args):
        import torch

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
        self.torch = torch

    def execute(self, requests):
        torch = self.torch
        pixels, counts, errors = [], [], {}
        for i, r in enumerate(requests):
            try:
                pv = tensors.input_array(r, N.PIXEL_VALUES)  # [images, 3, H, W]
                pv = np.zeros((0, 3, 1, 1), np.float32) if pv is None else pv
                check_pixel_values(pv, self.encoder.image_size)
                counts.append(pv.shape[0])
                if pv.shape[0]:
                    pixels.append(torch.from_numpy(np.ascontiguousarray(pv)))
            except Exception as e:  # noqa: BLE001
                errors[i] = e
                counts.append(0)
        try:
            if pixels:
                allpix = torch.cat(pixels)  # [sum images, 3, H, W]
                embeds = torch.cat([self.encoder(c) for c in allpix.split(self.chunk)])  # [sum images, T, hidden]
            else:
                embeds = self.encoder(torch.zeros(0, 3, 1, 1))
        except Exception as e:  # noqa: BLE001
            return [error_response(e) for _ in requests]
        out, start = [], 0
        for i, n in enumerate(counts):
            if i in errors:
                out.append(error_response(errors[i]))
                continue
            out.append(tensors.response({N.IMAGE_EMBEDS: (_OUT[N.IMAGE_EMBEDS], embeds[start:start + n].numpy())}))
            start += n
        return out
