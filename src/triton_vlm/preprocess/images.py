"""Image payloads -> RGB PIL images -> `pixel_values`, with the limits a server needs.

A payload is what a request carried for one image: the encoded file itself (raw bytes, from the gRPC/binary
`images` input) or base64 text of it, optionally as a `data:image/<subtype>;base64,` URL (the HTTP JSON
generate endpoint cannot carry raw bytes). Which one it is is decided by content, never by a label: the
text-generation-webui UI stores PNG bytes under a `data:image/jpeg` label.

`decode_image` checks the pixel count from the file header *before* decoding pixels (decompression bombs),
applies the EXIF orientation and converts every mode (RGBA / LA / P / L / I;16 / CMYK ...) to RGB, painting
transparent pixels over white. Every problem raises `InvalidArgument` naming the image (`what`).

`ImageProcessor` wraps the checkpoint's own Hugging Face image processor (loaded once), so `pixel_values` are
exactly what `AutoProcessor.from_pretrained(dir).image_processor(images)` returns.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import struct
import warnings
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import InvalidArgument

DEFAULT_MAX_PIXELS = 4096 * 4096  # per image, width * height
DEFAULT_MAX_IMAGES = 8  # per request
# The formats PIL may open (anything else is refused before a decoder runs).
ACCEPTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")

# file signatures of the accepted formats: a payload starting with one of these is raw file bytes
_MAGIC: tuple[bytes, ...] = (
    b"\xff\xd8\xff",  # JPEG
    b"\x89PNG\r\n\x1a\n",  # PNG
    b"GIF87a", b"GIF89a",
    b"BM",  # BMP
    b"II*\x00", b"MM\x00*",  # TIFF
)
_DATA_URL = re.compile(rb"^data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
_B64_CHARS = re.compile(rb"^[A-Za-z0-9+/\-_=]*$")
_WHITESPACE = re.compile(rb"\s+")


def _looks_raw(data: bytes) -> bool:
    if data.startswith(_MAGIC):
        return True
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def payload_to_bytes(payload: bytes | str | bytearray | memoryview, what: str = "image") -> bytes:
    """The encoded image file carried by `payload`: raw file bytes, base64 text or a base64 data URL.

    Decided by content: known image signatures are raw bytes; `data:` URLs and text in the base64 alphabet
    are decoded (whitespace ignored, missing padding tolerated, URL-safe alphabet accepted); anything else is
    passed on as raw bytes for the image decoder to judge.
    """
    if isinstance(payload, str):
        try:
            data = payload.encode("ascii")
        except UnicodeEncodeError:
            raise InvalidArgument(
                f"{what}: text payload is not base64 (non-ASCII characters); send the encoded image file as "
                "bytes, base64 text or a data:image/...;base64, URL") from None
    else:
        data = bytes(payload)
    if not data:
        raise InvalidArgument(f"{what} is empty")
    if _looks_raw(data):
        return data
    head = data[:64].lstrip()
    m = _DATA_URL.match(head)
    if m:
        params = [p.strip().lower() for p in m.group(2).split(b";") if p.strip()]
        if b"base64" not in params:
            raise InvalidArgument(f"{what}: data URL must be base64 encoded (data:image/...;base64,...)")
        start = len(data) - len(data.lstrip()) + m.end()
        return _b64decode(data[start:], what)
    compact = _WHITESPACE.sub(b"", data)
    if compact and _B64_CHARS.match(compact):
        return _b64decode(compact, what)
    return data


def _b64decode(text: bytes, what: str) -> bytes:
    compact = _WHITESPACE.sub(b"", text)
    if b"-" in compact or b"_" in compact:
        compact = compact.replace(b"-", b"+").replace(b"_", b"/")
    compact = compact.rstrip(b"=")
    if len(compact) % 4 == 1 or not compact:
        raise InvalidArgument(
            f"{what}: broken base64 ({len(compact)} base64 characters is not a valid length)")
    compact += b"=" * (-len(compact) % 4)
    try:
        out = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidArgument(f"{what}: broken base64 ({e})") from None
    if not out:
        raise InvalidArgument(f"{what} is empty after base64 decoding")
    return out


def _to_rgb(im: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB; transparency is composited over white."""
    if im.mode == "RGB" and "transparency" not in im.info:
        return im
    if im.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        arr = np.asarray(im, dtype=np.float64)
        # 16-bit samples -> 8 bit ("I" holds 16-bit PNGs too: scaled when values exceed 8 bits)
        if im.mode.startswith("I;16") or (im.mode == "I" and arr.max(initial=0) > 255):
            arr = arr / 257.0
        im = Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")
    has_alpha = im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (
        im.mode in ("P", "L", "RGB") and "transparency" in im.info)
    if has_alpha:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def header_size(raw: bytes) -> tuple[int, int] | None:
    """(height, width) from an image file's header, no pixel decoded (before the EXIF orientation, which may swap
    them); None when PIL cannot read the header (`decode_image` then says why)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw), formats=ACCEPTED_FORMATS) as im:
                return (int(im.height), int(im.width))
    except Exception:  # noqa: BLE001 - any unreadable header is judged by decode_image
        return None


def decode_image(data: bytes | str, what: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Payload (raw bytes / base64 / data URL) -> loaded RGB PIL image, EXIF orientation applied."""
    raw = payload_to_bytes(data, what)
    accepted = ", ".join(ACCEPTED_FORMATS)
    im = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(raw), formats=ACCEPTED_FORMATS)
            width, height = im.size  # from the header; no pixels decoded yet
            if width * height > max_pixels:
                raise InvalidArgument(
                    f"{what} is too large: {width}x{height} = {width * height} pixels, the limit is {max_pixels}")
            if width <= 0 or height <= 0:
                raise InvalidArgument(f"{what} has an empty size {width}x{height}")
            im.load()
    except InvalidArgument:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InvalidArgument(f"{what} is too large (decompression bomb guard: {e}); the limit is "
                              f"{max_pixels} pixels") from None
    except UnidentifiedImageError:
        raise InvalidArgument(
            f"{what} is not an image in an accepted format ({len(raw)} bytes starting {raw[:8]!r}); accepted: "
            f"{accepted}, as raw file bytes, base64 text or a data:image/...;base64, URL") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, MemoryError) as e:
        fmt = getattr(im, "format", None) or "image"
        raise InvalidArgument(f"{what}: broken or truncated {fmt} file ({e}); accepted: {accepted}") from None
    try:
        im = ImageOps.exif_transpose(im) or im
    except Exception:  # a malformed EXIF block must not fail the request; keep the stored orientation
        pass
    try:
        return _to_rgb(im)
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{what}: cannot convert {im.format} mode {im.mode} to RGB ({e})") from None


class ImageProcessor:
    """The checkpoint's own image processor, loaded once: RGB PIL images -> pixel_values float32.

    `__call__` gives [n, 3, H, W] (one tile per image); `per_image` gives each image's tiles [tiles, 3, H, W]
    for every processor: a tiling processor (LLaVA-NeXT's, [n, max tiles, 3, H, W] zero padded across the
    batch) is cut to each image's own tile count, `layout.tiles(image size)`."""

    def __init__(self, hf_image_processor: Any, image_size: tuple[int, int] | None = None, layout: Any = None):
        self.hf = hf_image_processor
        self.image_size = image_size  # (H, W) the processor produces; used for the empty batch
        self.layout = layout  # families.ImageLayout; needed for tiling processors

    @classmethod
    def load(cls, model_dir: str) -> "ImageProcessor":
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(str(model_dir)))

    def __call__(self, images: Sequence[Image.Image]) -> np.ndarray:
        if not images:
            if self.image_size is None:
                raise ValueError("image_size unknown: cannot build an empty pixel_values batch")
            return np.zeros((0, 3, *self.image_size), dtype=np.float32)
        out = self.hf(list(images), return_tensors="np")
        pv = np.asarray(out["pixel_values"], dtype=np.float32)  # [n, 3, H, W]
        if pv.ndim != 4 or pv.shape[0] != len(images) or pv.shape[1] != 3:
            raise ValueError(f"unexpected pixel_values shape {pv.shape} for {len(images)} images")
        return np.ascontiguousarray(pv)

    def per_image(self, images: Sequence[Image.Image]) -> list[np.ndarray]:
        """Each image's tiles [tiles_i, 3, H, W] float32, its own array (not a view of the batch)."""
        if not images:
            return []
        out = self.hf(list(images), return_tensors="np")
        pv = np.asarray(out["pixel_values"], dtype=np.float32)
        if pv.ndim == 4 and pv.shape[0] == len(images) and pv.shape[1] == 3:  # [n, 3, H, W]
            return [np.array(pv[i:i + 1]) for i in range(len(images))]
        if pv.ndim == 2 and "image_grid_thw" in out:  # native-resolution patches (Qwen2-VL): [patches, C*T*P*P]
            return self._patch_rows(pv, np.asarray(out["image_grid_thw"]), images)
        if pv.ndim != 5 or pv.shape[0] != len(images) or pv.shape[2] != 3 or self.layout is None:
            raise ValueError(f"unexpected pixel_values shape {pv.shape} for {len(images)} images")
        sizes = [(im.height, im.width) for im in images]
        reported = out.get("image_sizes")
        if reported is not None and [tuple(int(x) for x in r) for r in np.asarray(reported)] != sizes:
            raise ValueError(f"the image processor reports image_sizes {np.asarray(reported).tolist()}, not {sizes}")
        tiles = [self.layout.tiles(size) for size in sizes]
        if max(tiles) > pv.shape[1]:
            raise ValueError(f"the image processor gave {pv.shape[1]} tiles; the layout needs {max(tiles)}")
        return [np.array(pv[i, :k]) for i, k in enumerate(tiles)]  # [tiles_i, 3, H, W]

    def _patch_rows(self, pv: np.ndarray, grids: np.ndarray, images: Sequence[Image.Image]) -> list[np.ndarray]:
        """Qwen2-VL's rows [patches, 3 * T * P * P] -> each image's [patches_i, 3, T * P, P] (the same bytes),
        its grid checked against the family's layout."""
        want = [self.layout.grid((im.height, im.width)) for im in images]
        got = [tuple(int(x) for x in g) for g in grids]
        if got != want or pv.shape[0] != sum(t * h * w for t, h, w in got):
            raise ValueError(f"the image processor gives grids {got} for {len(pv)} patches; the layout {want}")
        th, tw = self.layout.tile_hw
        rows = pv.reshape(-1, 3, th, tw)
        if len(images) == 1:  # the processor's array is this image's own: no copy
            return [np.ascontiguousarray(rows)]
        starts = np.cumsum([0] + [t * h * w for t, h, w in got])
        return [np.array(rows[a:b]) for a, b in zip(starts, starts[1:])]
