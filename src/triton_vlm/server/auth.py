"""Which of Triton's APIs need which key, as tritonserver 2.51's restricted-API options.

Triton restricts an API category to requests carrying one header `KEY: VALUE` (`--http-restricted-api` and
`--grpc-restricted-protocol`, `<categories>:<KEY>=<VALUE>`; each category in one option at most, or tritonserver
refuses to start). Over gRPC the metadata key is `triton-grpc-protocol-<KEY>`; a refused request gets HTTP 403
or gRPC UNAVAILABLE ("This API is restricted, expecting header ..."). Two keys:

- the admin key (`TRITON_VLM_ADMIN_KEY`, random when unset) guards the admin APIs: load / unload models, shared
  memory, log and trace settings;
- the API key (`--api-key` / `TRITON_VLM_API_KEY`, optional), sent as `authorization: Bearer KEY`, guards every
  other API but health: inference, and what describes the deployment (model metadata and config, whose
  parameters name the checkpoint and adapter folders, and per-model statistics), as the OpenAI front end keeps
  /v1/models behind the same key. Health (server live / ready, model ready) stays open for probes.

Only light imports: the OpenAI front end uses the header names too.
"""
from __future__ import annotations

ADMIN_HEADER = "triton-vlm-admin-key"
ADMIN_APIS = ("model-repository", "shared-memory", "logging", "trace")
API_KEY_HEADER = "authorization"
API_KEY_APIS = ("inference", "metadata", "model-config", "statistics")
OPEN_APIS = ("health",)
GRPC_PREFIX = "triton-grpc-protocol-"  # Triton 2.51 reads a restricted key from this metadata over gRPC
GRPC_API_KEY_HEADER = GRPC_PREFIX + API_KEY_HEADER
GRPC_ADMIN_HEADER = GRPC_PREFIX + ADMIN_HEADER
ENV_API_KEY = "TRITON_VLM_API_KEY"


def check_key(key: str, what: str = "--api-key") -> str:
    """A key goes in an HTTP header and in gRPC metadata: printable ASCII, no space (ValueError otherwise)."""
    bad = sorted({c for c in key if not ("!" <= c <= "~")})
    if not key or bad:
        raise ValueError(f"{what} must be 1 or more printable ASCII characters without spaces (it goes in an "
                         f"HTTP header and in gRPC metadata); got {len(key)} characters"
                         + (f", among them {', '.join(repr(c) for c in bad[:5])}" if bad else ""))
    return key


def bearer(key: str) -> str:
    return f"Bearer {key}"


def restricted_args(admin_key: str, api_key: str | None) -> list[str]:
    """tritonserver's options restricting the admin APIs to the admin key and, with an API key, every other API
    but health to `authorization: Bearer KEY`, over HTTP and gRPC alike."""
    groups = [(ADMIN_APIS, ADMIN_HEADER, check_key(admin_key, "TRITON_VLM_ADMIN_KEY"))]
    if api_key:
        groups.append((API_KEY_APIS, API_KEY_HEADER, bearer(check_key(api_key))))
    out = []
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        out += [f"{flag}={','.join(apis)}:{header}={value}" for apis, header, value in groups]
    return out


def grpc_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries the API key to Triton (none without a key)."""
    return ((GRPC_API_KEY_HEADER, bearer(api_key)),) if api_key else ()


# --- where the ports listen ---------------------------------------------------------------------------------------
LOOPBACK = "127.0.0.1"  # the default of every port: reachable from this machine only
ENV_HOST = "TRITON_VLM_HOST"
EXPOSE_HINT = ("to listen on every interface: --host 0.0.0.0 with an API key (--api-key KEY, or $TRITON_VLM_API_KEY "
               "to keep it off the command line), or --insecure to serve without one")


def is_loopback(host: str) -> bool:
    """True when `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress  # noqa: PLC0415

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: whatever it resolves to, assume others can reach it
        return False


def exposure_error(host: str, api_key: str | None, insecure: bool) -> str | None:
    """Why listening on `host` is refused (a non-loopback address with no API key and no explicit --insecure), or
    None when it is allowed."""
    if is_loopback(host) or api_key or insecure:
        return None
    return (f"--host {host} would let anyone who reaches this machine use every model, read the deployment's "
            "metrics and send Triton the requests that crash it (docs/security.md), and no API key is set; "
            "give one (--api-key KEY or $TRITON_VLM_API_KEY), or pass --insecure to serve without one")


def connect_host(host: str) -> str:
    """The address this machine's own clients use to reach a port listening on `host` (a wildcard address
    listens on loopback too)."""
    if host in ("", "0.0.0.0", "::", "[::]") or is_loopback(host):
        return "localhost"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
