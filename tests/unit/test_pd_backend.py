"""The disaggregated backend's Serve calls: each is a Serve request of its own (fan-out in real
Serve: tests/e2e/test_serve_reliability.py)."""

from __future__ import annotations

from typing import Any

from ray.serve import context as serve_context

from router.pd_backend import own_call


class Method:
    """Stands in for a handle's method: `remote()` answers the internal id Serve would use."""

    def remote(self, *args: Any) -> str:
        return serve_context._get_serve_request_context()._internal_request_id


def test_calls_made_while_serving_one_request_get_ids_of_their_own() -> None:
    serve_context._set_request_context(request_id="http-1", _internal_request_id="ingress-1")
    try:
        ids = [own_call(Method(), i) for i in range(3)]
        ambient = serve_context._get_serve_request_context()
    finally:
        serve_context._unset_request_context()
    assert len(set(ids)) == 3 and "ingress-1" not in ids
    assert ambient._internal_request_id == "ingress-1" and ambient.request_id == "http-1"
