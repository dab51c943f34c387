"""The floor for a Python ASGI proxy on this machine: uvicorn (uvloop, httptools) and aiohttp,
forwarding each POST to `BARE_PROXY_UPSTREAM` and its answer back (a streamed answer, `text/event-stream`,
relayed chunk by chunk as it arrives), and nothing else: no key, no limits, no balancing, no metering,
no logging.

`bench/bench_gateway.py` measures it next to the gateway, against the same mock, to show how much
of the gateway's overhead is the serving stack itself.

    BARE_PROXY_UPSTREAM=http://127.0.0.1:PORT uvicorn bench.bare_proxy:app --loop uvloop --http httptools
"""

import os

import aiohttp

UPSTREAM = os.environ.get("BARE_PROXY_UPSTREAM", "")
_client: aiohttp.ClientSession | None = None


async def app(scope, receive, send):
    global _client
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        if _client is not None:
            await _client.close()
        return await send({"type": "lifespan.shutdown.complete"})
    if _client is None:
        _client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2000, limit_per_host=0))
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["path"] == "/health":
        answer, status = b"ok", 200
    else:
        async with _client.post(UPSTREAM + scope["path"], data=body, headers={"content-type": "application/json"}) as response:
            if response.content_type == "text/event-stream":
                await send({"type": "http.response.start", "status": response.status,
                            "headers": [(b"content-type", b"text/event-stream")]})
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                return await send({"type": "http.response.body", "body": b""})
            answer, status = await response.read(), response.status
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})
