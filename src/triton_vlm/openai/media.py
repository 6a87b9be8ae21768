"""`image_url` -> the image file's bytes, sent to the ensemble's `images` input (decoded there, by content); and
`video_url` (vLLM's form) -> the video file's bytes for its `videos` input, by the same rules (a data:video/ URL, or
http(s) from allowed hosts; not sniffed here: preprocess decodes and checks videos), at most `max_video_bytes`.

- `data:` URLs (base64): PNG, JPEG, WebP and GIF, recognised by their bytes;
- `http(s)` URLs only for hosts the operator allows (`--allowed-image-domains example.com,*.example.org`),
  and only at public addresses and allowed ports (fetch.py: the SSRF checks, redirects re-checked, one error
  text for every network failure), fetched with a size limit (the body is read up to `max_bytes`; a larger
  `Content-Length` is refused before reading) and a time limit for the whole fetch;
- at most `max_images` images and `max_videos` videos per request, both counted before anything is fetched
  (`load_media`);
- anything else (`file:`, local paths, other schemes) is refused. Every refusal is a 400 naming the URL's kind
  and what is allowed.
"""
from __future__ import annotations

import base64
import binascii
import urllib.parse
from dataclasses import dataclass

from ..params import DEFAULT_MAX_VIDEOS
from ..preprocess.images import DEFAULT_MAX_IMAGES
from .aio import gather_all
from .errors import bad_request
from .fetch import DEFAULT_PORTS, FetchFailed, TooLarge, fetch

FORMATS = ("PNG", "JPEG", "WebP", "GIF")
DEFAULT_MAX_BYTES = 20 << 20
DEFAULT_TIMEOUT_S = 10.0


def sniff(data: bytes) -> str | None:
    """The image format of a file by its first bytes, or None when it is none of FORMATS."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    return None


def _checked(data: bytes, what: str, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise bad_request(f"{what} is {len(data)} bytes; at most {max_bytes} are accepted", param="messages")
    if sniff(data) is None:
        raise bad_request(f"{what} is not a PNG, JPEG, WebP or GIF image (first bytes {data[:8]!r})",
                          param="messages")
    return data


def decode_data_url(url: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise bad_request("an image data URL must be base64: data:image/<png|jpeg|webp|gif>;base64,<data>",
                          param="messages")
    media = header[5:].split(";", 1)[0].lower()
    if media and not media.startswith("image/"):
        raise bad_request(f"data URL of type {media!r} is not an image", param="messages")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise bad_request(f"image data URL is over {max_bytes} bytes", param="messages")
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"image data URL is not valid base64 ({e})", param="messages") from None
    return _checked(data, "the image of a data URL", max_bytes)


DEFAULT_MAX_VIDEO_BYTES = 64 << 20


def decode_video_data_url(url: str, max_bytes: int = DEFAULT_MAX_VIDEO_BYTES) -> bytes:
    """A `video_url`'s data:video/...;base64 URL -> the file (decoded and checked by preprocess)."""
    header, sep, payload = url.partition(",")
    media = header[5:].split(";", 1)[0].lower()
    if not sep or ";base64" not in header or (media and not media.startswith("video/")):
        raise bad_request(f"a video data URL must be data:video/<type>;base64,<data>, got {header[:40]!r}",
                          param="messages")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise bad_request(f"video data URL is over {max_bytes} bytes", param="messages")
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"video data URL is not valid base64 ({e})", param="messages") from None


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()  # host names; "*.example.org" allows its subdomains
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_images: int = DEFAULT_MAX_IMAGES  # per request (the preprocess model's max_images)
    ports: tuple[int, ...] = DEFAULT_PORTS  # of http(s) image URLs
    allow_private: bool = False  # fetch from loopback / private / link-local addresses too (fetch.py)
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES  # a video_url's file
    max_videos: int = DEFAULT_MAX_VIDEOS  # per request (the preprocess model's max_videos)

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for d in self.allowed_domains:
            d = d.lower().rstrip(".")
            if host == d or (d.startswith("*.") and host.endswith(d[1:])):
                return True
        return False

    def check_counts(self, n_images: int, n_videos: int = 0) -> None:
        """400 when a request holds more images than `max_images` or more videos than `max_videos`."""
        for n, most, kind in ((n_images, self.max_images, "images"), (n_videos, self.max_videos, "videos")):
            if n > most:
                raise bad_request(f"the request has {n} {kind}; at most {most} are accepted", param="messages")

    async def load_media(self, image_urls: list[str], video_urls: list[str]) -> tuple[list[bytes], list[bytes]]:
        """Every image and video of a request, fetched concurrently once both counts are known to be within
        `max_images` / `max_videos` (the preprocess model decodes and checks them: their cost, frame and pixel
        limits); the first failure cancels the other fetches."""
        self.check_counts(len(image_urls), len(video_urls))
        out = await gather_all([*(self.load(u) for u in image_urls), *(self.load(u, "video") for u in video_urls)])
        return out[:len(image_urls)], out[len(image_urls):]

    async def load_all(self, urls: list[str]) -> list[bytes]:
        """Every image of a request (`load_media` without videos)."""
        return (await self.load_media(urls, []))[0]

    async def load_videos(self, urls: list[str]) -> list[bytes]:
        """Every video of a request (`video_url`), counted against `max_videos` before any is fetched."""
        return (await self.load_media([], urls))[1]

    async def load(self, url: str, kind: str = "image") -> bytes:
        """The bytes of the image an `image_url` (or the video a `video_url`) names; APIError(400) when it may not
        or cannot be loaded."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        limit = self.max_bytes if kind == "image" else self.max_video_bytes
        if scheme == "data":
            return decode_data_url(url, limit) if kind == "image" else decode_video_data_url(url, limit)
        if scheme not in ("http", "https"):
            raise bad_request(f"{kind}_url must be a data: URL{' or an http(s) URL' if self.allowed_domains else ''}"
                              f"; {scheme or 'a path'!s} URLs are not accepted", param="messages")
        host = urllib.parse.urlsplit(url).hostname or ""
        if not self.allowed_domains:
            raise bad_request(f"{kind} URLs over http(s) are not accepted by this server (it was started without "
                              f"--allowed-image-domains); send the {kind} as a data: URL", param="messages")
        if not self.host_allowed(host):
            raise bad_request(f"{kind} host {host!r} is not allowed; allowed: {', '.join(self.allowed_domains)}",
                              param="messages")
        try:
            data = await fetch(url, host_allowed=self.host_allowed, max_bytes=limit,
                               timeout_s=self.timeout_s, ports=self.ports, allow_private=self.allow_private)
        except TooLarge as e:
            raise bad_request(f"the {kind} at {url} is over {limit} bytes ({e.size} or more); at most "
                              f"{limit} are accepted", param="messages") from None
        except FetchFailed:
            raise bad_request(f"the {kind} at {url} could not be fetched ({kind}s are fetched from public addresses "
                              f"of allowed hosts, ports {', '.join(map(str, self.ports))}, within "
                              f"{self.timeout_s:g} s)", param="messages") from None
        return _checked(data, f"the image at {url}", limit) if kind == "image" else data
