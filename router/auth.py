"""The API key: with one set, every path but the probes needs `Authorization: Bearer <key>`.

Open without the key: `/health`, `/ping` (liveness probes), `/metrics` (the scraper) and
`/version`, which vLLM leaves open too. Generation and tokenization are guarded wherever they
sit: `/v1/*`, and also `/invocations`, `/tokenize` and `/detokenize`, which vLLM (guarding only
`/v1`) leaves open: each runs the model or its tokenizer for whoever can reach the port.
`open_invocations` opens `/invocations` for a SageMaker endpoint whose gateway authenticates.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
INVOCATIONS = "/invocations"


class APIKeyMiddleware:
    """401 with OpenAI's body for a guarded request without the key (pure ASGI: streams pass)."""

    def __init__(self, app: ASGIApp, api_key: str, open_invocations: bool = False) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open = OPEN_PATHS | ({INVOCATIONS} if open_invocations else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401,
            "Unauthorized: a valid API key is needed (Authorization: Bearer <key>)",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        path: str = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path.rstrip("/") in self.open:
            return True
        header = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.expected)
