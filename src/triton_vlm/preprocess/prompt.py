"""Split a prompt into text parts and image parts, as text-generation-webui's multimodal extension does.

Two ways to put an image in a prompt, freely mixed in one prompt:

* inline: `<img src="data:image/<subtype>;base64,<base64>">` carries its own data. Any `data:image/...` label
  is accepted and ignored: the bytes are decoded by content (webui stores PNG bytes under the jpeg label).
* marker: `<image>` in the text, paired in order with the request's `images` list (the i-th marker takes
  `images[i]`). The number of markers must equal `len(images)` exactly; inline images are not counted.

Image start/end marker strings (e.g. `<Img>` / `</Img>`) are added to the text around each image, so
`text1<image>text2` becomes `['text1<Img>', <image>, '</Img>text2']`. Empty text parts are left out.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Sequence, Union

from ..errors import InvalidArgument

IMAGE_MARKER = "<image>"
# webui's regex is `<img src="data:image/jpeg;base64,([A-Za-z0-9+/=]+)">`; we accept any image subtype
INLINE_IMAGE = re.compile(r'<img src="data:image/[A-Za-z0-9.+-]*;base64,(?P<b64>[A-Za-z0-9+/=]+)">')
# An inline image tag that does not match INLINE_IMAGE (`<img ... src=... data:image/` up to the tag's `>`) is
# refused rather than fed to the model as text. Found in O(n log n) by `find_malformed_inline`: a regex like
# `<img\s[^>]*src...` rescans to the end of the text from every `<img` and is quadratic on hostile prompts.
_IMG_OPEN = re.compile(r"<img\s", re.I)
_DATA_SRC = re.compile(r'src\s*=\s*["\']?data:image/', re.I)


def find_malformed_inline(text: str) -> int | None:
    """Start of the first `<img ...>` tag (or unclosed `<img ...`) whose `src` is a `data:image/` URL, or None."""
    srcs = [m.start() for m in _DATA_SRC.finditer(text)]
    if not srcs:
        return None
    end = -1  # the `>` closing the tag that starts at the current `<img` (shared by every `<img` before it)
    for m in _IMG_OPEN.finditer(text):
        i = m.start()
        if end < i:
            end = text.find(">", i)
            end = len(text) if end < 0 else end
        k = bisect.bisect_right(srcs, i)
        if k < len(srcs) and srcs[k] < end:
            return i
    return None


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    payload: Union[bytes, str]  # encoded image file, base64 text or data URL; decoded later by content
    index: int  # position among the prompt's images, in prompt order (0-based)
    what: str  # how error messages name this image, e.g. "images[1]" or "inline image 0 of text_input"
    kind: str = "image"  # or "video" (a video file of `videos`, Qwen2-VL)


Part = Union[TextPart, ImagePart]


def _pattern(markers: tuple[str, ...], video_markers: tuple[str, ...] = ()) -> re.Pattern:
    alts = [f"(?P<inline>{INLINE_IMAGE.pattern})"]
    if any(markers):
        alts.append("(?P<marker>" + "|".join(re.escape(m) for m in markers if m) + ")")
    if any(video_markers):
        alts.append("(?P<video>" + "|".join(re.escape(m) for m in video_markers if m) + ")")
    return re.compile("|".join(alts))


_PATTERNS: dict[tuple, re.Pattern] = {}


def split_prompt(
    text: str,
    images: Sequence[Union[bytes, str]] = (),
    *,
    image_start: str = "",
    image_end: str = "",
    marker: str | tuple[str, ...] = IMAGE_MARKER,
    max_images: int | None = None,
    videos: Sequence[Union[bytes, str]] = (),
    video_markers: tuple[str, ...] = (),
) -> list[Part]:
    """text (+ images for the markers) -> [TextPart | ImagePart, ...] in prompt order, markers added. `marker`:
    the image marker, or several (a family's own format besides `<image>`: Qwen2-VL's
    `<|vision_start|><|image_pad|><|vision_end|>`), any of which takes the next image of `images`.

    Raises InvalidArgument when the marker count differs from `len(images)` (stating both counts) or when
    the prompt holds more than `max_images` images in total.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    images, videos = list(images or ()), list(videos or ())
    markers = (marker,) if isinstance(marker, str) else tuple(marker)
    marker = markers[0] if markers else ""
    key = (markers, tuple(video_markers))
    pat = _PATTERNS.get(key) or _PATTERNS.setdefault(key, _pattern(markers, tuple(video_markers)))
    matches = list(pat.finditer(text))
    n_videos = sum(1 for m in matches if m.lastgroup == "video")
    if n_videos != len(videos):
        shown = video_markers[0] if video_markers else "<video>"
        raise InvalidArgument(
            f"text_input has {n_videos} {shown} markers but {len(videos)} videos were sent in `videos`"
            + ("" if video_markers else " (this checkpoint takes no videos)")
            + f"; send exactly one video per {shown} marker, in order")
    n_markers = sum(1 for m in matches if m.lastgroup == "marker")
    n_inline = len(matches) - n_markers - n_videos
    if n_markers != len(images):
        inline_note = f" (plus {n_inline} inline <img> images, which carry their own data)" if n_inline else ""
        raise InvalidArgument(
            f"text_input has {n_markers} {marker} markers{inline_note} but {len(images)} images were sent in "
            f"`images`; send exactly one image per {marker} marker, in order")
    if max_images is not None and len(matches) - n_videos > max_images:
        raise InvalidArgument(
            f"too many images: {len(matches) - n_videos} in the request ({n_markers} {marker} markers, {n_inline} inline), "
            f"at most {max_images} are allowed")

    parts: list[Part] = []
    pending = ""  # text waiting to become a TextPart
    pos = 0
    next_listed = next_video = 0
    n_seen_inline = 0
    for idx, m in enumerate(matches):
        pending += text[pos:m.start()] + image_start
        if pending:
            parts.append(TextPart(pending))
        if m.lastgroup == "video":
            parts.append(ImagePart(videos[next_video], idx, f"videos[{next_video}]", kind="video"))
            next_video += 1
        elif m.group("inline") is not None:
            parts.append(ImagePart(m.group("b64"), idx, f"inline image {n_seen_inline} of text_input"))
            n_seen_inline += 1
        else:
            parts.append(ImagePart(images[next_listed], idx, f"images[{next_listed}]"))
            next_listed += 1
        pending = image_end
        pos = m.end()
    pending += text[pos:]
    if pending:
        parts.append(TextPart(pending))
    for p in parts:
        bad = find_malformed_inline(p.text) if isinstance(p, TextPart) else None
        if bad is not None:
            snippet = p.text[bad:bad + 60]
            raise InvalidArgument(
                f"malformed inline image in text_input near {snippet!r}: expected "
                '<img src="data:image/<type>;base64,<base64 characters A-Z a-z 0-9 + / =>">')
    return parts


def image_parts(parts: Sequence[Part]) -> list[ImagePart]:
    return [p for p in parts if isinstance(p, ImagePart)]
