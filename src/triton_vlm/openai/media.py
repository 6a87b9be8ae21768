"""`image_url` -> the image file's bytes, sent to the ensemble's `images` input (decoded there, by content).

- `data:` URLs (base64): PNG, JPEG, WebP and GIF, recognised by their bytes;
- `http(s)` URLs only for hosts the operator allows (`--allowed-image-domains example.com,*.example.org`),
  fetched with a size limit (the body is read up to `max_bytes`; a larger `Content-Length` is refused before
  reading) and a time limit for the whole fetch; redirects are followed only to allowed hosts;
- anything else (`file:`, local paths, other schemes) is refused. Every refusal is a 400 naming the URL's kind
  and what is allowed.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from .errors import bad_request

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


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()  # host names; "*.example.org" allows its subdomains
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for d in self.allowed_domains:
            d = d.lower().rstrip(".")
            if host == d or (d.startswith("*.") and host.endswith(d[1:])):
                return True
        return False

    async def load(self, url: str) -> bytes:
        """The bytes of the image an `image_url` names; APIError(400) when it may not or cannot be loaded."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_data_url(url, self.max_bytes)
        if scheme not in ("http", "https"):
            raise bad_request(f"image_url must be a data: URL{' or an http(s) URL' if self.allowed_domains else ''}"
                              f"; {scheme or 'a path'!s} URLs are not accepted", param="messages")
        host = urllib.parse.urlsplit(url).hostname or ""
        if not self.allowed_domains:
            raise bad_request("image URLs over http(s) are not accepted by this server (it was started without "
                              "--allowed-image-domains); send the image as a data: URL", param="messages")
        if not self.host_allowed(host):
            raise bad_request(f"image host {host!r} is not allowed; allowed: {', '.join(self.allowed_domains)}",
                              param="messages")
        return await asyncio.to_thread(self._fetch, url)

    def _fetch(self, url: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        opener = urllib.request.build_opener(_AllowedRedirects(self))
        try:
            with opener.open(urllib.request.Request(url, headers={"User-Agent": "triton-vlm"}),
                             timeout=self.timeout_s) as resp:
                length = resp.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise bad_request(f"image at {url} is {length} bytes; at most {self.max_bytes} are accepted",
                                      param="messages")
                chunks, size = [], 0
                while size <= self.max_bytes:
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    chunk = resp.read(min(1 << 16, self.max_bytes + 1 - size))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
        except (TimeoutError, OSError, urllib.error.URLError) as e:
            if isinstance(e, urllib.error.HTTPError):
                raise bad_request(f"fetching image {url} failed: HTTP {e.code}", param="messages") from None
            reason = "timed out" if isinstance(e, TimeoutError) or "timed out" in str(e) else str(e)
            raise bad_request(f"fetching image {url} failed ({reason}; limit {self.timeout_s:g} s)",
                              param="messages") from None
        return _checked(b"".join(chunks), f"the image at {url}", self.max_bytes)


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, policy: MediaPolicy):
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        parts = urllib.parse.urlsplit(newurl)
        if parts.scheme not in ("http", "https") or not self.policy.host_allowed(parts.hostname or ""):
            raise bad_request(f"image URL redirects to {newurl}, which is not allowed", param="messages")
        return super().redirect_request(req, fp, code, msg, headers, newurl)
