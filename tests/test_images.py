"""images: payload detection (raw / base64 / data URL), decoding, limits, modes, EXIF, pixel_values exactness."""
import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from triton_vlm.errors import InvalidArgument
from triton_vlm.preprocess.images import (
    ACCEPTED_FORMATS,
    DEFAULT_MAX_PIXELS,
    ImageProcessor,
    decode_image,
    payload_to_bytes,
)


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def two_tone(size=(40, 20)) -> Image.Image:
    """Left half red, right half blue."""
    w, h = size
    arr = np.zeros((h, w, 3), np.uint8)
    arr[:, : w // 2] = (255, 0, 0)
    arr[:, w // 2:] = (0, 0, 255)
    return Image.fromarray(arr, "RGB")


def png_with_header_size(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, followed by a tiny (truncated) IDAT: decoding would fail."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16))


# --- payload detection -------------------------------------------------------------------------------------
def test_raw_bytes_pass_through():
    png = encode(two_tone())
    assert payload_to_bytes(png) == png
    assert payload_to_bytes(bytearray(png)) == png
    jpg = encode(two_tone(), "JPEG")
    assert payload_to_bytes(jpg) == jpg


@pytest.mark.parametrize("form", ["str", "bytes", "data_url_jpeg_label", "data_url_png_label", "newlines",
                                  "no_padding", "urlsafe"])
def test_base64_forms_decode_by_content(form):
    png = encode(two_tone((13, 7)))  # length chosen so base64 has padding
    b64 = base64.b64encode(png).decode()
    assert b64.endswith("=")
    payload = {
        "str": b64,
        "bytes": b64.encode(),
        "data_url_jpeg_label": "data:image/jpeg;base64," + b64,  # PNG bytes under the jpeg label (webui)
        "data_url_png_label": b"data:image/png;base64," + b64.encode(),
        "newlines": "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)) + "\n",
        "no_padding": b64.rstrip("="),
        "urlsafe": base64.urlsafe_b64encode(png).decode(),
    }[form]
    assert payload_to_bytes(payload) == png
    im = decode_image(payload)
    assert im.mode == "RGB" and im.size == (13, 7)


@pytest.mark.parametrize("payload,needle", [
    ("data:image/png;base64,!!!notbase64", "broken base64"),
    ("QUJDR", "broken base64"),  # 5 characters: impossible length
    ("QU=JD", "broken base64"),  # padding in the middle
    ("data:image/png,rawtext", "must be base64"),
    ("", "empty"),
    ("héllo", "not base64"),
])
def test_broken_base64_is_invalid_argument_naming_the_image(payload, needle):
    with pytest.raises(InvalidArgument) as e:
        decode_image(payload, "images[3]")
    assert needle in str(e.value) and "images[3]" in str(e.value)


def test_not_an_image_names_index_and_accepted_formats():
    for payload in (b"this is plain text, not an image at all!", base64.b64encode(b"just some words").decode(),
                    b"%PDF-1.4 fake"):
        with pytest.raises(InvalidArgument) as e:
            decode_image(payload, "images[2]")
        msg = str(e.value)
        assert "images[2]" in msg and "not an image" in msg
        assert all(f in msg for f in ACCEPTED_FORMATS)


def test_truncated_image_is_invalid_argument():
    png = encode(Image.effect_noise((64, 64), 50).convert("RGB"))
    with pytest.raises(InvalidArgument, match="images\\[0\\]: broken or truncated PNG"):
        decode_image(png[: len(png) // 2], "images[0]")


# --- size limits -------------------------------------------------------------------------------------------
def test_oversized_image_says_size_and_cap():
    with pytest.raises(InvalidArgument, match=r"images\[1\] is too large: 100x60 = 6000 pixels, the limit is 5000"):
        decode_image(encode(two_tone((100, 60))), "images[1]", max_pixels=5000)
    assert decode_image(encode(two_tone((100, 50))), max_pixels=5000).size == (100, 50)


def test_size_checked_from_header_before_decoding():
    # 5000x5000 claimed by the header, no real pixel data: the size cap fires, not a decode error
    with pytest.raises(InvalidArgument, match=f"5000x5000 = 25000000 pixels, the limit is {DEFAULT_MAX_PIXELS}"):
        decode_image(png_with_header_size(5000, 5000))
    # the same file under a generous cap gets to the decoder, which finds it truncated
    with pytest.raises(InvalidArgument, match="broken or truncated"):
        decode_image(png_with_header_size(5000, 5000), max_pixels=10**8)


def test_pil_decompression_bomb_guards_become_invalid_argument():
    # 10000x10000 > PIL's MAX_IMAGE_PIXELS: PIL warns (turned into our error); 20000x20000: PIL raises
    for side in (10_000, 20_000):
        with pytest.raises(InvalidArgument, match="too large"):
            decode_image(png_with_header_size(side, side), "images[0]", max_pixels=10**10)


def test_image_count_limit():
    from triton_vlm.preprocess.prompt import split_prompt

    assert len(split_prompt("<image>" * 8, [b"x"] * 8, max_images=8)) == 8
    with pytest.raises(InvalidArgument, match="too many images: 9 .* at most 8"):
        split_prompt("<image>" * 9, [b"x"] * 9, max_images=8)


# --- modes, formats, orientation ---------------------------------------------------------------------------
def test_exif_orientation_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored image must be rotated 90 degrees clockwise for display
    jpg = encode(two_tone((40, 20)), "JPEG", exif=exif, quality=95)
    im = decode_image(jpg)
    assert im.size == (20, 40)
    arr = np.asarray(im).astype(int)
    assert arr[5, 10, 0] > 200 and arr[5, 10, 2] < 60  # top: what was the left (red) half
    assert arr[35, 10, 2] > 200 and arr[35, 10, 0] < 60  # bottom: the right (blue) half


def test_alpha_is_composited_over_white():
    rgba = Image.new("RGBA", (4, 2), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 255, 0))  # fully transparent -> white
    rgba.putpixel((1, 0), (0, 0, 0, 128))  # half transparent black -> grey
    arr = np.asarray(decode_image(encode(rgba)))
    assert arr[0, 0].tolist() == [255, 255, 255]
    assert 120 <= arr[0, 1, 0] <= 135 and arr[0, 1, 0] == arr[0, 1, 1] == arr[0, 1, 2]
    assert arr[1, 3].tolist() == [255, 0, 0]
    la = Image.new("LA", (2, 2), (0, 0))
    assert np.asarray(decode_image(encode(la))).tolist() == [[[255] * 3] * 2] * 2


def test_palette_with_transparency_and_other_modes():
    p = Image.new("P", (3, 1))
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    p.putpixel((0, 0), 0)
    p.putpixel((1, 0), 1)
    p.putpixel((2, 0), 1)
    p.info["transparency"] = 1
    arr = np.asarray(decode_image(encode(p)))
    assert arr[0, 0].tolist() == [255, 0, 0] and arr[0, 1].tolist() == [255, 255, 255]

    rgb_key = Image.new("RGB", (2, 1), (255, 0, 0))
    rgb_key.putpixel((1, 0), (0, 255, 0))
    arr = np.asarray(decode_image(encode(rgb_key, transparency=(255, 0, 0))))  # tRNS colour key
    assert arr[0, 0].tolist() == [255, 255, 255] and arr[0, 1].tolist() == [0, 255, 0]

    grey = np.asarray(decode_image(encode(Image.new("L", (2, 2), 77))))
    assert grey.shape == (2, 2, 3) and (grey == 77).all()

    cmyk = decode_image(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=100))
    r, g, b = np.asarray(cmyk)[4, 4].astype(int)
    assert cmyk.mode == "RGB" and r > 230 and g < 30 and b < 30

    sixteen = Image.fromarray(np.full((2, 3), 65535 // 2, np.uint16))
    arr = np.asarray(decode_image(encode(sixteen)))
    assert arr.shape == (2, 3, 3) and abs(int(arr[0, 0, 0]) - 127) <= 1


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_accepted_formats_decode(fmt):
    data = encode(two_tone((16, 8)), fmt)
    im = decode_image(data)
    assert im.mode == "RGB" and im.size == (16, 8)
    assert decode_image(base64.b64encode(data)).size == (16, 8)


def test_unaccepted_format_refused():
    data = encode(two_tone((8, 8)), "PPM")
    with pytest.raises(InvalidArgument, match="not an image in an accepted format"):
        decode_image(data)


# --- pixel_values equal the checkpoint's own processor -----------------------------------------------------
@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    from triton_vlm.demo.checkpoint import build_random_llava

    return build_random_llava(tmp_path_factory.mktemp("llava_images"), image_size=32, patch_size=8)


def test_pixel_values_equal_hf_image_processor(checkpoint):
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(str(checkpoint)).image_processor
    ours = ImageProcessor.load(checkpoint)
    payloads = [encode(two_tone((40, 20))), encode(Image.effect_noise((50, 70), 60).convert("RGB"), "JPEG"),
                encode(two_tone((32, 32)), "WEBP")]
    images = [decode_image(p) for p in payloads]
    expected = hf(images, return_tensors="pt").pixel_values.numpy()
    got = ours(images)
    assert got.dtype == np.float32 and got.shape == (3, 3, 32, 32) == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    # decoding by content matches the plain PIL route for an ordinary RGB file
    plain = Image.open(io.BytesIO(payloads[1])).convert("RGB")
    np.testing.assert_allclose(ours([plain]), hf([plain], return_tensors="pt").pixel_values.numpy(), atol=1e-5)
    assert np.abs(got[0] - got[2]).max() > 0.1  # different images -> different pixels


def test_empty_batch_shape(checkpoint):
    ours = ImageProcessor.load(checkpoint)
    ours.image_size = (32, 32)
    out = ours([])
    assert out.shape == (0, 3, 32, 32) and out.dtype == np.float32
