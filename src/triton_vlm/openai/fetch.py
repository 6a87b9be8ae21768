"""Fetching an image over http(s) without letting a client reach the server's own network (SSRF).

Every URL (the first and each redirect's) is checked before it is connected to: scheme http or https, a port of
`ports` (80 and 443 by default), a host the operator allows (`MediaPolicy.host_allowed`). The host name is
resolved once (getaddrinfo, by the connector's resolver below) and every address it resolves to must be public:
loopback, private, link-local, shared (CGNAT), multicast, reserved and unspecified addresses and the cloud
metadata addresses are refused (all but the metadata ones allowed with `allow_private`). The connection is made
to exactly the addresses checked, so a name that resolves differently a moment later (DNS rebinding) cannot
point it elsewhere. Redirects are followed by hand, at most `MAX_REDIRECTS`, each checked as the first URL.

A refused address, a refused port or redirect, a connection or DNS failure, an HTTP error status and a timeout
all get one error text (`FetchFailed`): which of them happened is not told to the client, so the API cannot be
used to map the server's network. The size limit and the image format are checked on what a fetch returned.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse
from typing import Callable

import aiohttp
from aiohttp.abc import AbstractResolver

MAX_REDIRECTS = 3
DEFAULT_PORTS = (80, 443)
# instance metadata services (AWS, GCP, Azure, OpenStack: 169.254.169.254; AWS IPv6; Alibaba): never fetched
METADATA = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
_REDIRECTS = (301, 302, 303, 307, 308)


class FetchFailed(Exception):
    """Any refusal or failure of a fetch (one text for all; see the module's doc)."""


class TooLarge(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


def address_allowed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allow_private: bool) -> bool:
    """A public unicast address (or, with `allow_private`, any address but the metadata ones)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip in METADATA:
        return False
    if allow_private:
        return True
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


class _CheckedResolver(AbstractResolver):
    """getaddrinfo, refusing the whole name when any of its addresses is not allowed."""

    def __init__(self, allow_private: bool):
        self.allow_private = allow_private

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_UNSPEC) -> list[dict]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=family,
                                                                 type=socket.SOCK_STREAM)
        except OSError:
            raise FetchFailed from None
        out = []
        for fam, _, proto, _, sockaddr in infos:
            if not address_allowed(ipaddress.ip_address(sockaddr[0].split("%", 1)[0]), self.allow_private):
                raise FetchFailed
            out.append({"hostname": host, "host": sockaddr[0], "port": sockaddr[1], "family": fam,
                        "proto": proto, "flags": socket.AI_NUMERICHOST | socket.AI_NUMERICSERV})
        if not out:
            raise FetchFailed
        return out

    async def close(self) -> None:
        pass


def check_url(url: str, host_allowed: Callable[[str], bool], ports: tuple[int, ...], allow_private: bool) -> None:
    """FetchFailed unless `url` may be connected to (its name's addresses are checked when it is resolved)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise FetchFailed from None
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or port not in ports or not host_allowed(host):
        raise FetchFailed
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return  # a name: checked by _CheckedResolver
    if not address_allowed(ip, allow_private):  # the connector does not resolve a literal address
        raise FetchFailed


async def fetch(url: str, *, host_allowed: Callable[[str], bool], max_bytes: int, timeout_s: float,
                ports: tuple[int, ...] = DEFAULT_PORTS, allow_private: bool = False) -> bytes:
    """The body at `url` (at most `max_bytes`, else TooLarge), within `timeout_s` for the whole fetch."""
    connector = aiohttp.TCPConnector(resolver=_CheckedResolver(allow_private), use_dns_cache=False,
                                     force_close=True)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         headers={"User-Agent": "triton-vlm"}) as session:
            return await asyncio.wait_for(_follow(session, url, host_allowed, max_bytes, ports, allow_private),
                                          timeout_s)
    except (FetchFailed, TooLarge):
        raise
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        raise FetchFailed from None


async def _follow(session, url: str, host_allowed, max_bytes: int, ports, allow_private: bool) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        check_url(url, host_allowed, ports, allow_private)
        async with session.get(url, allow_redirects=False) as resp:
            if resp.status in _REDIRECTS and resp.headers.get("Location"):
                url = urllib.parse.urljoin(url, resp.headers["Location"])
                continue
            if resp.status != 200:
                raise FetchFailed
            length = resp.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise TooLarge(int(length))
            chunks, size = [], 0
            async for chunk in resp.content.iter_chunked(1 << 16):
                size += len(chunk)
                if size > max_bytes:
                    raise TooLarge(size)
                chunks.append(chunk)
            return b"".join(chunks)
    raise FetchFailed  # too many redirects
