"""API keys on the HTTP front end: an ASGI middleware that authenticates every ``/v1/*`` request
(and vLLM's ``/tokenize``, ``/detokenize``)
from ``Authorization: Bearer KEY`` before the application reads its body, and answers 401 with
OpenAI's error JSON (``type`` ``invalid_request_error``, ``code`` ``invalid_api_key``, as
OpenAI's API does) and ``WWW-Authenticate: Bearer`` (RFC 6750) otherwise. Other paths
(``/health``, ``/ready``, ``/metrics``) stay open for probes and scrapers. The accepted
identity is left in ``request.state.identity`` for the route (``services/gateway/access.py``).
"""
from __future__ import annotations

import uuid

from starlette.responses import JSONResponse

from services.gateway.access import Access
from services.gateway.keys import ANONYMOUS, Identity, Unauthenticated

PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = ("/tokenize", "/detokenize")  # vLLM's, outside /v1: they use the model too


class ApiKeyMiddleware:
    """Pure ASGI (no body buffering, streams pass through untouched)."""

    def __init__(self, app, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # NOTE: the last of repeated headers wins
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        try:
            identity = self.access.authenticate(authorization)
        except Unauthenticated as exc:
            rid = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
            body = {"error": {"message": str(exc),
                              "type": "invalid_request_error", "param": None,
                              "code": "invalid_api_key"}}
            await JSONResponse(body, status_code=401, headers={
                "WWW-Authenticate": "Bearer", "X-Request-Id": rid})(scope, receive, send)
            return
        scope.setdefault("state", {})["identity"] = identity
        await self.app(scope, receive, send)


def request_identity(request) -> Identity:
    """The identity ``ApiKeyMiddleware`` accepted for ``request`` (anonymous without it)."""
    return getattr(request.state, "identity", ANONYMOUS)
