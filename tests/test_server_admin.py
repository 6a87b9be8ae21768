"""Triton's admin APIs through gRPC: refused without the admin key, answered with it (HTTP:
`test_resilience.py::test_admin_apis_need_the_admin_key`).

Triton's gRPC front end reads the key of `--grpc-restricted-protocol=<apis>:<key>=<value>` from the metadata
`triton-grpc-protocol-<key>` and refuses with UNAVAILABLE (HTTP uses the header `<key>` and 403)."""
from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_vlm.server.process import ADMIN_HEADER

pytestmark = pytest.mark.server

GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"


@pytest.mark.parametrize("call", ["get_system_shared_memory_status", "get_model_repository_index",
                                  "get_log_settings", "get_trace_settings"])
def test_grpc_admin_apis_need_the_admin_key(triton_server, call):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        for headers in (None, {ADMIN_HEADER: triton_server.admin_key}, {GRPC_ADMIN_HEADER: "wrong"}):
            with pytest.raises(InferenceServerException) as e:
                getattr(client, call)(headers=headers)
            assert e.value.status() == "StatusCode.UNAVAILABLE", (headers, e.value)
            assert f"expecting header '{GRPC_ADMIN_HEADER}'" in e.value.message(), e.value
        getattr(client, call)(headers={GRPC_ADMIN_HEADER: triton_server.admin_key})  # answered
        assert client.is_server_ready() and client.get_model_metadata("ensemble").name == "ensemble"  # open APIs
    finally:
        client.close()
