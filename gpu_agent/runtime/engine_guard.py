"""The lock on every engine: an ASGI middleware vLLM loads (`--middleware`) in front of its server.

vLLM's own `--api-key` guards only paths under `/v1`, `/v2`, `/inference` and `/cohere`; `/invocations`,
`/tokenize`, `/pooling`, `/score`, `/metrics` and others stay open, so anything that reaches an engine's
port would get unmetered inference. This guard refuses every request that lacks the replica's key,
whatever the path, except `GET /health` (the agent's liveness probe, which reveals nothing).

The key is per replica and random: the control plane makes it, sends it to the agent in that
replica's spec, the agent hands it to the engine in `ENGINE_API_KEY_ENV` (never on the command line,
which `ps` and the replica's log show), and the gateway sends it with every call. With no key in the
environment the guard refuses everything but the probe: an engine is never open by mistake.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

ENGINE_API_KEY_ENV = "INFERPLANE_ENGINE_API_KEY"
OPEN_PATHS = frozenset({"/health"})

_UNAUTHORIZED = json.dumps(
    {"error": {"message": "Missing or invalid engine key.", "type": "authentication_error", "code": 401}}
).encode()


class EngineKeyGuard:
    """Pure ASGI: `Authorization: Bearer <key>` on every HTTP and WebSocket request but the probe."""

    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get(ENGINE_API_KEY_ENV, "")
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if self._digest is None:
            return False
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                return hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.allows(scope.get("headers") or []):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({
            "type": "http.response.start", "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                        (b"www-authenticate", b"Bearer")],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
