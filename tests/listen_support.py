"""Where a port listens, read as an outsider would: the bound addresses (what `ss -ltn` shows, read from
/proc/net/tcp{,6} as ss does), and a connection to an address of this machine other than loopback (which only a
port listening on every interface accepts)."""
from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess


LISTEN = "0A"  # the TCP state of a listening socket in /proc/net/tcp


def bound_addresses(port: int) -> set[str]:
    """The local addresses TCP sockets listen on at `port` (e.g. {'127.0.0.1'}), as `ss -ltn` lists them."""
    found = set()
    for name, size in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/net/{name}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for row in rows:
            addr, _, hex_port = row[1].partition(":")
            if row[3] == LISTEN and int(hex_port, 16) == port:
                raw = bytes.fromhex(addr)  # the kernel's 32-bit words, each in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                ip = ipaddress.ip_address(words)
                mapped = getattr(ip, "ipv4_mapped", None)  # gRPC listens on 127.0.0.1 as ::ffff:127.0.0.1
                found.add(str(mapped or ip))
    return found


def outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None when it has none): a client on the network
    reaches the machine there."""
    if shutil.which("hostname") is None:
        return None
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=30).stdout.split()
    for a in out:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        if ip.version == 4 and not ip.is_loopback:
            return a
    return None


def connects(address: str, port: int) -> bool:
    """True when a TCP connection to address:port is accepted."""
    try:
        with socket.create_connection((address, port), timeout=5):
            return True
    except OSError:
        return False
