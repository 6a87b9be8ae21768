"""Request -> model inputs: prompt ids with image placeholders, pixel_values, bad/stop word ids, truncation.

Steps of `Preprocessor.__call__`:

1. split the prompt into text / image parts (`prompt.split_prompt`: inline `<img src="data:image/...">` tags
   and `<image>` markers paired with `images`; image start/end markers added around each image);
2. cost every image and video from its header before any pixel is decoded (`images.header_size`,
   `videos.probe_video` with the family's `video_plan`): its tokens and the bytes of pixels it will hold, checked
   against the request's media budget (`max_media_tokens`, `max_media_bytes`: `params.check_media_budget`); a video
   whose tokens alone exceed `context_length - max_tokens` is refused (it could never be kept). Then decode and
   validate EVERY image (`images.decode_image`; a request's images on `decode_threads` threads at once,
   `media_pool.py`) and video (`videos.decode_frames`: one frame at a time, resized as
   it arrives), also those truncation will drop: a broken, oversized or non-image payload is an error whatever
   `max_tokens` is, so a request's validity never depends on the token budget;
3. tokenize the whole prompt once, each image written as ONE placeholder token, with the tokenizer's special
   tokens (BOS first, as the tokenizer adds it), then expand each placeholder to that image's token count
   (the family's `layout.tokens(height, width)`: the same for every image of llava-1.5, a function of the
   image's size for LLaVA-NeXT). Tokenizing in context (not part by part) is what the checkpoint's own
   processor does, so the ids equal `LlavaProcessor` / `LlavaNextProcessor(text=..., images=...)` exactly for
   any tokenizer (sentencepiece prefix spaces, merges across part boundaries). A video's placeholder becomes what the family's
   processor writes for it (`Family.video_text`: Qwen3-VL's `<t seconds>` timestamp and vision start / end around
   each temporal patch), tokenized on its own between the marker's special tokens;
4. truncate when the prompt is longer than `context_length - max_tokens`: keep the LAST tokens, dropping
   whole parts from the left; an image is never split (dropped whole, with its true token count and all its
   tiles); a text part may be cut. The BOS token (when the tokenizer adds one) is kept in front of a truncated prompt and counts
   against the budget. If the last part alone cannot fit, InvalidArgument states the sizes;
5. run the checkpoint's image processor on the kept images only: each image's tiles (one for llava-1.5; the
   base tile and the grid's for LLaVA-NeXT) and its size (with `decode_threads` > 1, one call per image on the
   pool: the same bytes as one call on them all);
6. tokenize bad / stop words one by one without special tokens (empty words ignored).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from .checkpoint import ModelInfo, load_components
from ..families import get_family
from .. import names as N
from ..errors import InvalidArgument
from .image_cache import ImageCache, ProcessedImage, image_key
from .media_pool import MediaPool
from .images import (DEFAULT_MAX_IMAGES, DEFAULT_MAX_PIXELS, ImageProcessor, decode_image, header_size,
                     payload_to_bytes)
from ..params import (DEFAULT_MAX_MEDIA_BYTES, DEFAULT_MAX_MEDIA_TOKENS, DEFAULT_MAX_VIDEOS, MediaCost,
                      check_media_budget, check_word_count, words_to_flat)
from .prompt import IMAGE_MARKER, ImagePart, TextPart, split_prompt

VIDEO_MARKER = "<video>"

Text = Union[str, bytes]


@dataclass
class PreprocessResult:
    input_ids: list[int]  # [T] prompt ids; each kept image is its token count of image_token_id copies
    pixel_values: np.ndarray  # [tiles, 3, H, W] float32: the tiles of the kept images, in prompt order
    bad_words_ids: list[list[int]] = field(default_factory=list)
    stop_words_ids: list[list[int]] = field(default_factory=list)
    dropped_images: int = 0  # images removed by truncation
    image_sizes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))  # [n_kept, 2] (H, W)
    # native-resolution families: each kept image's / video's patch grid (t, h, w) and a video's seconds per
    # temporal patch (0 for an image); zeros for the fixed-tile families
    media_grids: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))  # [n_kept, 3]
    media_seconds: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.float32))  # [n_kept]


@dataclass
class _Segment:
    ids: list[int]
    image: int = -1  # index into the prompt's images, -1 for text


def _as_str(value: Text, name: str) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"{name} is not valid UTF-8 ({e})") from None
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be text, got {type(value).__name__}")
    return value


CHARS_PER_TOKEN_BOUND = 32  # text of a prompt may be up to this many characters per context token (~4 is usual)


class Preprocessor:
    """Loads the checkpoint's tokenizer and image processor once; `__call__` serves one request."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_images: int = DEFAULT_MAX_IMAGES,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        context_length: int | None = None,
        image_start: str = "",
        image_end: str = "",
        pipeline: str | None = None,
        marker: str = IMAGE_MARKER,
        image_cache_size: int = 64,
        max_text_chars: int = 0,
        max_videos: int = DEFAULT_MAX_VIDEOS,
        max_media_tokens: int = DEFAULT_MAX_MEDIA_TOKENS,
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
        decode_threads: int = 1,
    ):
        """`max_text_chars`: longest prompt text accepted (inline images not counted); 0 = context length x
        `CHARS_PER_TOKEN_BOUND`. Longer text is refused before tokenization, which is linear but costs ~1 s per
        MB: a prompt many times the context would be truncated to a small fraction of itself anyway.
        `decode_threads`: a request's images decoded and processed by that many threads at once (`MediaPool`;
        1 = one after another), after its media budget was checked."""
        if max_images < 0 or max_pixels <= 0 or max_media_tokens <= 0 or max_media_bytes <= 0:
            raise ValueError(f"max_images must be >= 0 and max_pixels, max_media_tokens, max_media_bytes > 0, got "
                             f"{max_images}, {max_pixels}, {max_media_tokens}, {max_media_bytes}")
        self.max_media_tokens, self.max_media_bytes = max_media_tokens, max_media_bytes
        comps = load_components(model_dir)
        self.info = ModelInfo.load(model_dir, pipeline=pipeline, context_length=context_length,
                                   image_start=image_start, image_end=image_end, components=comps)
        self.tokenizer = comps.tokenizer
        self.image_processor = ImageProcessor(comps.image_processor, self.info.image_size, self.info.layout)
        self.max_images = max_images
        self.max_pixels = max_pixels
        self.marker = marker
        family = get_family(self.info.pipeline)
        # any of these in the prompt takes the next of `images`: `<image>` and the family's own format
        self.markers = (marker,) + family.image_markers
        self.whole_images = bool(getattr(self.info.layout, "whole_images", False))
        self.video = None  # the family's videos (Qwen2-VL): `<video>` / its own marker paired with `videos`
        if family.video_token is not None:
            from .videos import VideoProcessor, video_config  # noqa: PLC0415 - PyAV only where videos are taken

            self.video = VideoProcessor(video_config(model_dir, family.video_defaults), family.video_plan)
            self.video_text = family.video_text
            self.video_token_id = int(self.tokenizer.convert_tokens_to_ids(family.video_token))
            self.video_token = family.video_token
            self.video_markers = (VIDEO_MARKER,) + family.video_markers
        self.max_videos = max_videos
        self.cache = ImageCache(image_cache_size)
        self.pool = MediaPool(decode_threads)
        self.max_text_chars = max_text_chars or self.info.context_length * CHARS_PER_TOKEN_BOUND

    # --- words -------------------------------------------------------------------------------------------
    def encode_words(self, words: Sequence[Text] | None, name: str = "words") -> list[list[int]]:
        """Each non-empty word -> its ids without special tokens."""
        check_word_count(name, len(words or ()))
        out = []
        for i, w in enumerate(words or ()):
            w = _as_str(w, f"{name}[{i}]")
            if not w:
                continue
            ids = self.tokenizer(w, add_special_tokens=False)["input_ids"]
            if ids:
                out.append([int(t) for t in ids])
        return out

    # --- prompt ------------------------------------------------------------------------------------------
    def _tokenize(self, parts, media: Sequence["_Media"]) -> list[_Segment]:
        """Parts -> [text ids | image placeholders] segments, tokenized in context (see module doc); image k
        takes media[k].count placeholders, a video its `ids` where the family writes more (timestamps)."""
        info = self.info
        video_id = self.video_token_id if self.video is not None else None
        joined = "".join(p.text if isinstance(p, TextPart) else
                         self.video_token if p.kind == "video" else info.image_token for p in parts)
        ids = [int(t) for t in self.tokenizer(joined, add_special_tokens=True)["input_ids"]]
        n_images = sum(isinstance(p, ImagePart) for p in parts)
        n_found = ids.count(info.image_token_id) + (ids.count(video_id) if video_id is not None else 0)
        if n_found != n_images:
            raise InvalidArgument(
                f"text_input contains the model's image placeholder token {info.image_token!r} outside an image "
                f"({n_found} placeholders for {n_images} images); put images in with {self.marker} markers or "
                "<img src=\"data:image/...;base64,...\"> tags")
        segments, current, k = [], [], 0
        for t in ids:
            if t == info.image_token_id or (video_id is not None and t == video_id):
                if current:
                    segments.append(_Segment(current))
                segments.append(_Segment(media[k].ids or [t] * media[k].count, image=k))
                current, k = [], k + 1
            else:
                current.append(t)
        if current:
            segments.append(_Segment(current))
        return segments

    def _truncate(self, segments: list[_Segment], budget: int, max_tokens: int) -> list[_Segment]:
        total = sum(len(s.ids) for s in segments)
        if total <= budget:
            return segments
        info = self.info
        prefix: list[int] = []
        if info.add_bos and segments and segments[0].image < 0 and segments[0].ids[:1] == [info.bos_token_id]:
            prefix = segments[0].ids[:1]
            segments = [_Segment(segments[0].ids[1:])] + segments[1:]
            segments = [s for s in segments if s.ids]
        room = budget - len(prefix)
        kept: list[_Segment] = []
        for seg in reversed(segments):
            if len(seg.ids) <= room:
                kept.append(seg)
                room -= len(seg.ids)
                continue
            if seg.image < 0 and room > 0:
                kept.append(_Segment(seg.ids[len(seg.ids) - room:]))
            break
        if not kept:
            last = segments[-1] if segments else None
            what = (f"the last image alone takes {len(last.ids)} tokens and images are never split"
                    if last is not None and last.image >= 0 else "no prompt token fits")
            raise InvalidArgument(
                f"prompt of {total} tokens cannot be truncated to fit: context length {info.context_length} - "
                f"max_tokens {max_tokens} leaves {budget} prompt tokens"
                f"{' (1 taken by BOS)' if prefix else ''}, and {what}; lower max_tokens")
        kept.reverse()
        return ([_Segment(prefix)] if prefix else []) + kept

    def __call__(
        self,
        text: Text,
        images: Sequence[Union[bytes, str]] | None = None,
        max_tokens: int | None = 16,
        bad_words: Sequence[Text] | None = None,
        stop_words: Sequence[Text] | None = None,
        videos: Sequence[Union[bytes, str]] | None = None,
    ) -> PreprocessResult:
        info = self.info
        if text is None:
            raise InvalidArgument("input 'text_input' is required (the prompt, BYTES [1]) but was not sent")
        if max_tokens is None:
            raise InvalidArgument(f"input 'max_tokens' is required (INT32 [1], 1..{info.context_length}) "
                                  "but was not sent")
        text = _as_str(text, "text_input")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
            raise InvalidArgument(f"max_tokens must be an integer, got {max_tokens!r}")
        max_tokens = int(max_tokens)
        if not 1 <= max_tokens <= info.context_length:
            raise InvalidArgument(
                f"max_tokens must be in [1, {info.context_length}] (the context length), got {max_tokens}")
        budget = info.context_length - max_tokens

        videos = list(videos or ())
        if len(videos) > self.max_videos:
            raise InvalidArgument(f"too many videos: {len(videos)} in the request, at most {self.max_videos} are "
                                  "allowed")
        parts = split_prompt(text, list(images or ()), image_start=info.image_start, image_end=info.image_end,
                             marker=self.markers, max_images=self.max_images, videos=videos,
                             video_markers=self.video_markers if self.video is not None else ())
        n_chars = sum(len(p.text) for p in parts if isinstance(p, TextPart))
        if n_chars > self.max_text_chars:
            raise InvalidArgument(
                f"text_input holds {n_chars} characters of text (inline images not counted); at most "
                f"{self.max_text_chars} are accepted (context length {info.context_length} x "
                f"{CHARS_PER_TOKEN_BOUND}); send a shorter prompt")
        media = self._decode([p for p in parts if isinstance(p, ImagePart)], budget, max_tokens)  # also dropped ones
        segments = self._truncate(self._tokenize(parts, media), budget, max_tokens)
        kept = [media[s.image] for s in segments if s.image >= 0]
        self._process([m for m in kept if m.kind == "image"])
        return PreprocessResult(
            input_ids=[t for s in segments for t in s.ids],
            pixel_values=(np.concatenate([m.pixels for m in kept]) if kept else
                          np.zeros((0, 3, *info.image_size), np.float32)),  # [tiles, 3, H, W]
            bad_words_ids=self.encode_words(bad_words, "bad_words"),
            stop_words_ids=self.encode_words(stop_words, "stop_words"),
            dropped_images=len(media) - len(kept),
            image_sizes=np.array([m.size for m in kept], np.int32).reshape(-1, 2),
            media_grids=np.array([m.grid for m in kept], np.int32).reshape(-1, 3),
            media_seconds=np.array([m.seconds for m in kept], np.float32),
        )

    def _decode(self, parts: list[ImagePart], budget: int, max_tokens: int) -> list["_Media"]:
        """Every image and video of the prompt costed from its header and checked against the request's media budget,
        then decoded and validated (images found in the cache are not), with its placeholder count: a request's
        validity never depends on what truncation drops."""
        pending = [self._probe(p, budget, max_tokens) for p in parts]
        check_media_budget([c.cost for c in pending], self.max_media_tokens, self.max_media_bytes)
        return self.pool.map(lambda pc: self._load(*pc), list(zip(parts, pending)))

    def _probe(self, p: ImagePart, budget: int, max_tokens: int) -> "_Pending":
        """One medium's cost from its header (nothing decoded); a video that cannot fit the context is refused."""
        return self._probe_video(p, budget, max_tokens) if p.kind == "video" else self._probe_image(p)

    def _probe_video(self, p: ImagePart, budget: int, max_tokens: int) -> "_Pending":
        from .videos import probe_video  # noqa: PLC0415

        header = probe_video(p.payload, p.what, self.video.cfg, self.max_pixels, planner=self.video.plan)
        if header.plan.tokens > budget:
            raise InvalidArgument(
                f"{p.what}: {header.describe()}; the context leaves {budget} prompt tokens (context length "
                f"{self.info.context_length} - max_tokens {max_tokens}); send a shorter or smaller video or "
                "lower max_tokens")
        plan = header.plan
        return _Pending(MediaCost(p.what, plan.tokens, plan.frame_bytes + plan.pixel_bytes, header.describe()),
                        header=header)

    def _probe_image(self, p: ImagePart) -> "_Pending":
        raw = payload_to_bytes(p.payload, p.what)
        key = image_key(raw)
        hit = self.cache.get(key)
        size = hit.size if hit is not None else header_size(raw)
        tokens = nbytes = 0
        if size is not None and size[0] * size[1] <= self.max_pixels:  # else decode_image says what is wrong
            try:  # both orientations: the EXIF orientation, applied when decoding, may turn the image
                tokens = max(self.info.image_tokens(s) for s in (size, size[::-1]))
                tiles = max(self.info.layout.tiles(s) for s in (size, size[::-1])) if self.info.layout else 1
            except InvalidArgument:  # a size the family refuses: refused by name when loaded
                tiles = 0
            th, tw = self.info.image_size
            nbytes = (0 if hit is not None else size[0] * size[1] * 3) + tiles * 3 * th * tw * 4
        detail = f"{size[1]}x{size[0]} pixels, {tokens} tokens" if size is not None else "unreadable"
        return _Pending(MediaCost(p.what, tokens, nbytes, detail), raw=raw, key=key, hit=hit)

    def _load(self, p: ImagePart, pending: "_Pending") -> "_Media":
        if pending.header is not None:
            from .videos import decode_frames  # noqa: PLC0415

            video = decode_frames(pending.header, p.what)
            rows, grid, seconds = self.video(video)  # the patches now: a video is never cached here
            return _Media("video", video.size, video.plan.tokens, grid, seconds, pixels=rows,
                          ids=self._video_ids(video.plan))
        hit = pending.hit
        im = None if hit is not None else decode_image(pending.raw, p.what, self.max_pixels)
        size = hit.size if hit is not None else (im.height, im.width)
        grid = self.info.layout.grid(size) if self.whole_images else (0, 0, 0)
        return _Media("image", size, _image_tokens(self.info, size, p.what), grid, 0.0,
                      pixels=None if hit is None else hit.pixels, decoded=im, key=pending.key)

    def _video_ids(self, plan) -> list[int]:
        """A video's ids where the family's processor writes more than its placeholders (Qwen3-VL: a timestamp and
        the vision start / end around each temporal patch), else [] (`video_text`). The text is tokenized on its own:
        it starts after and ends before special tokens (the marker's vision start / end), which the tokenizer never
        merges across, so the ids are those the processor's whole-prompt tokenization gives."""
        text = self.video_text(plan)
        if text is None:
            return []
        ids = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if ids.count(self.video_token_id) != plan.tokens:
            raise InvalidArgument(f"the family's video text holds {ids.count(self.video_token_id)} placeholders for "
                                  f"{plan.tokens} video tokens")
        return ids

    def _process(self, images: list["_Media"]) -> None:
        """The checkpoint's image processor on the kept images not found in the cache (all in one call)."""
        todo = [m for m in images if m.pixels is None]
        if self.pool.threads > 1 and len(todo) > 1:  # each image on its own: the same bytes (tested)
            processed = self.pool.map(lambda m: self.image_processor.per_image([m.decoded])[0], todo)
        else:
            processed = self.image_processor.per_image([m.decoded for m in todo])
        for m, px in zip(todo, processed):
            m.pixels = px  # [tiles, 3, H, W], its own array
            self.cache.put(m.key, ProcessedImage(px, m.size))


@dataclass
class _Pending:
    """One medium between its header and its pixels: its cost, and what loading it needs."""

    cost: MediaCost
    header: Any = None  # a video's `videos.VideoHeader`
    raw: bytes = b""  # an image's file
    key: bytes = b""  # an image's cache key
    hit: Optional[ProcessedImage] = None  # an image found in the cache


@dataclass
class _Media:
    """One image or video of a prompt while it is preprocessed."""

    kind: str  # "image" or "video"
    size: tuple[int, int]  # (height, width) of the image / of the video's frames
    count: int  # placeholder tokens
    grid: tuple[int, int, int]  # (t, h, w) patches (native resolution; zeros for the fixed-tile families)
    seconds: float  # a video's seconds per temporal patch; 0 for an image
    pixels: Optional[np.ndarray] = None  # [tiles, 3, H, W] once processed (or found in the cache)
    decoded: Any = None  # the decoded PIL image still to process
    key: bytes = b""  # an image's cache key (the SHA-256 of its file)
    ids: list[int] = field(default_factory=list)  # a video's ids when not `count` placeholders (timestamps)


def _image_tokens(info: ModelInfo, size: tuple[int, int], what: str) -> int:
    """The placeholders of an image of `size`; a size the family refuses names the image."""
    try:
        return info.image_tokens(size)
    except InvalidArgument as e:
        raise InvalidArgument(f"{what}: {e.message}") from None


def stack_rows(results: Sequence[PreprocessResult]) -> dict[str, np.ndarray]:
    """The outputs of a request's rows (one per prompt), each with the batch dim, rows padded to a common shape
    (see `names.INPUT_IDS_PAD`); a single row is not padded at all."""
    b = len(results)
    length = max(len(r.input_ids) for r in results)
    input_ids = np.full((b, length), N.INPUT_IDS_PAD, np.int32)  # [B, T]
    n_img = [len(r.image_sizes) for r in results]
    n_tiles = [int(r.pixel_values.shape[0]) for r in results]
    shape = results[0].pixel_values.shape[1:]
    pixel_values = np.zeros((b, max(n_tiles), *shape), np.float32)  # [B, tiles, 3, H, W]
    sizes = np.zeros((b, max(n_img), 2), np.int32)  # [B, images, 2]
    grids = np.zeros((b, max(n_img), 3), np.int32)  # [B, images, 3]
    seconds = np.zeros((b, max(n_img)), np.float32)  # [B, images]
    words = {}
    for name, get in ((N.BAD_WORDS_IDS, lambda r: r.bad_words_ids), (N.STOP_WORDS_IDS, lambda r: r.stop_words_ids)):
        flats = [words_to_flat(get(r)) for r in results]
        words[name] = np.zeros((b, max(len(f) for f in flats)), np.int32)  # [B, W], 0 = end of the list
        for i, f in enumerate(flats):
            words[name][i, :len(f)] = f
    for i, r in enumerate(results):
        input_ids[i, :len(r.input_ids)] = r.input_ids
        pixel_values[i, :n_tiles[i]] = r.pixel_values
        sizes[i, :n_img[i]] = r.image_sizes
        grids[i, :n_img[i]] = r.media_grids
        seconds[i, :n_img[i]] = r.media_seconds
    return {
        N.INPUT_IDS: input_ids,
        N.PIXEL_VALUES: pixel_values,
        **words,
        N.DROPPED_IMAGES: np.array([[r.dropped_images] for r in results], np.int32),  # [B, 1]
        N.NUM_IMAGES: np.array([[n] for n in n_img], np.int32),  # [B, 1]
        N.IMAGE_SIZES: sizes,
        N.MEDIA_GRIDS: grids,
        N.MEDIA_SECONDS: seconds,
    }
