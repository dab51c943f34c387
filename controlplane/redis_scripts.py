"""Lua scripts: the one way to run one, `Script`, on one pipelined Redis connection per event loop.

`await script(keys=..., args=...)` from async code; `script.run_sync(keys=..., args=...)` from
synchronous code, on the shared redis-py client. Nothing else calls EVAL, EVALSHA or
`register_script`.

Every request through the gateway runs two scripts (`endpoints/gateway/admission.py`). redis-py's
asyncio client takes a pooled connection, wraps each command in retry and health-check layers and
parses replies in Python: about a third of the gateway's CPU per request in `bench/bench_gateway.py`.
Here all concurrent callers share one socket: each call writes its EVALSHA and waits for its reply,
replies come back in order, and one read can answer many callers. Everything else keeps using
`controlplane.redis_client`.

Only what scripts need: `redis://` and `rediss://` URLs (password, database), RESP2 replies, EVALSHA
with a fallback to EVAL when the server does not know the script yet. A lost connection fails the
calls in flight with `ConnectionError` (as redis-py would) and the next call reconnects.

On Redis Cluster (`REDIS_CLUSTER=1`) scripts run on redis-py's async cluster client instead, which
sends each to the node that owns its keys' slot (they must share one: `controlplane.redis_keys`).

NOTE: every call has a deadline (`REDIS_TIMEOUT_S`, connecting included). Replies come in order, so
one overdue reply means the connection is stuck (a frozen or partitioned Redis): a watchdog then
drops the connection, failing every call waiting on it with `RedisTimeout` at once, and opens the process's circuit
(`controlplane.redis_circuit`): until a probe of its own is answered, every call fails at once with `RedisTimeout`,
rather than each opening a new connection into the same silence and waiting out its deadline. A request never hangs
on a silent Redis.

NOTE: redis-py's clients retry a command once after a connection error (`controlplane.redis_client`; its
cluster clients on a timeout too), and cannot tell a command that never reached Redis from one whose
reply was lost: the retry may run a script a second time. A script that a second run would change more
(one that adds a cost, unguarded) is made with `once=True`: each call carries a token of its own
(`redis_keys.once_key`, in the slot of its first key), and a second run of the same call finds the
token and answers the first run's reply, changing nothing. The gateway's two scripts a request, and its replica pick
and place in line, need no token: each finds what its first run wrote (the request's entry in its gateway's requests
hash, its place) and answers from it (`endpoints.gateway.admission`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import secrets
import ssl
from collections import deque
from collections.abc import Awaitable
from urllib.parse import unquote, urlparse

import redis.exceptions
from django.conf import settings

from controlplane.hot_settings import hot
from controlplane.per_loop import PerLoop
from controlplane.redis_circuit import Refused, circuit
from controlplane.redis_client import get_async_redis, get_redis
from controlplane.redis_keys import once_key


class RedisError(Exception):
    """An error reply from Redis."""


class RedisTimeout(ConnectionError, TimeoutError):
    """Redis did not answer in time; the connection was dropped."""


class RedisRefused(RedisTimeout, Refused):
    """Not sent: Redis left a call unanswered past its deadline, and has not answered since (`controlplane.redis_circuit`)."""


class RedisUnavailable(ConnectionError):
    """Redis answered that it cannot serve now (loading its data after a restart, a replica without
    its primary, out of memory under `maxmemory`, refusing writes after a failed save, busy with a
    script): an outage, not an error in the call."""


_UNAVAILABLE_PREFIXES = ("LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "OOM", "MISCONF", "BUSY",
                         "NOREPLICAS")
# NOTE: a refusal met by a command inside a script comes wrapped: `ERR Error running script (…): … -OOM …`.
# Redis refuses a script's write for memory only before its first write, so nothing was half done.
_IN_SCRIPT = ("ERR Error running script", "Error running script")  # redis-py drops the reply's "ERR "
_UNAVAILABLE_IN_SCRIPT = tuple(f"-{prefix} " for prefix in _UNAVAILABLE_PREFIXES)


def says_unavailable(message: str) -> bool:
    """Whether an error reply says Redis cannot serve now, rather than that the call was wrong."""
    return message.startswith(_UNAVAILABLE_PREFIXES) or (
        message.startswith(_IN_SCRIPT) and any(marker in message for marker in _UNAVAILABLE_IN_SCRIPT))


# How long a call's token outlives its first run: far longer than redis-py takes to send it again (at once, on a new
# connection, each bounded by `REDIS_TIMEOUT_S`).
ONCE_TTL_S = 300

# A `once` script: its source as a function, run unless the call's token (its last key) says it ran; the reply kept in
# the token as JSON (strings, arrays, integers of up to 14 digits: cjson's precision).
_ONCE_LUA = """
local once = KEYS[#KEYS]
local ran = redis.call('GET', once)
if ran then return cjson.decode(ran)[1] end
local function run()
%s
end
local reply = run()
redis.call('SET', once, cjson.encode({reply}), 'EX', %d)
return reply
"""


class Script:
    """A Lua script, run with `await script(keys=[...], args=[...])` on this loop's connection.

    `once`: a call that a client sends again runs once (see the module's docstring); the script reads its own keys
    by position from `KEYS[1]` (the token is the last). `small_args`: its arguments are a request's small fields (ids,
    counts, flags), encoded through the cache its keys are (`_encode_evalsha_small_args`), never rows or bodies."""

    def __init__(self, source: str, *, once: bool = False, small_args: bool = False):
        self.once = once
        self._encode = _encode_evalsha_small_args if small_args else _encode_evalsha
        if once:
            source = _ONCE_LUA % (source, ONCE_TTL_S)
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self._evalsha = _bulk(b"EVALSHA") + _bulk(self.sha.encode())  # every call's first two parts, in RESP

    async def __call__(self, *, keys: list, args: list):
        if not circuit.admits():
            raise RedisRefused("Redis is not answering")
        if self.once:
            keys = [*keys, once_key(keys[0], secrets.token_hex(8))]
        if hot.REDIS_CLUSTER:
            return await self._run_on_cluster(keys, args)
        connection = _connections.get()
        try:
            return await connection.send(self._encode(self._evalsha, keys, args))
        except RedisError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            return await connection.call(b"EVAL", self.source, len(keys), *keys, *args)

    async def _run_on_cluster(self, keys: list, args: list):
        client = get_async_redis()
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)

    def run_sync(self, *, keys: list, args: list):
        """The same script from synchronous code (tasks, the control plane), on the process's shared
        client (`controlplane.redis_client.get_redis`); raises redis-py's exceptions."""
        if self.once:
            keys = [*keys, once_key(keys[0], secrets.token_hex(8))]
        client = get_redis()
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(self.source, len(keys), *keys, *args)


class _Incomplete(Exception):
    """The buffer ends inside a reply."""


def _as_bytes(part) -> bytes:
    if isinstance(part, bytes):
        return part
    if isinstance(part, str):
        return part.encode()
    if isinstance(part, float):
        # NOTE: `-0.0` as `0.0`, as Redis reads either: equal values of a type encode alike, which the cache of
        # encodings (`_key_bulk`, keyed by value) needs; it gave `-0.0` the bytes of a `0.0` sent before, and back.
        return repr(part + 0.0).encode()
    if isinstance(part, int) and not isinstance(part, bool):
        return repr(part).encode()
    raise TypeError(f"cannot send {type(part).__name__} to Redis")


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _bulk_of(part) -> bytes:
    return _bulk(part.encode() if type(part) is str else b"%d" % part if type(part) is int else _as_bytes(part))


# NOTE: a script's keys and most of its arguments repeat from one request to the next (an organisation's
# counters, an endpoint's sets, a replica's counter, a key's limits): each is encoded once and then found here.
# The few that are new each time (a request's settled marker, its id) pass through and are the first to leave.
# `typed`: `True` and `1`, `1.0` and `1` are told apart (a bool is refused, a float encoded as its repr).
_key_bulk = functools.lru_cache(maxsize=4096, typed=True)(_bulk_of)


def _encode(parts: tuple) -> bytes:
    """A command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(parts) + b"".join([_bulk_of(part) for part in parts])


def _encode_evalsha(head: bytes, keys: list, args: list) -> bytes:
    """`EVALSHA <sha> <number of keys> <keys> <args>` in RESP; `head` is its first two parts, encoded.

    NOTE: the arguments as `_bulk_of` encodes them, inline: two scripts a request pass ~30, and the two calls
    per argument were a third of the encoding's time."""
    parts = [b"*%d\r\n" % (3 + len(keys) + len(args)), head, _bulk(b"%d" % len(keys))]
    parts += map(_key_bulk, keys)
    for arg in args:
        if type(arg) is int:
            arg = b"%d" % arg
        elif type(arg) is str:
            arg = arg.encode()
        elif type(arg) is not bytes:
            arg = _as_bytes(arg)
        parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(parts)


def _encode_evalsha_small_args(head: bytes, keys: list, args: list) -> bytes:
    """`_encode_evalsha` for a script whose arguments are all small and mostly recur (`Script(small_args=True)`):
    they too come from the cache of encoded parts, as its keys do.

    NOTE: a request's two scripts (`endpoints.gateway.admission`) pass ~37 arguments, most the same from one request to
    the next (a key's limits, a TTL, a flag) and a request's own (its id, its call token) recurring between its scripts
    and their parts: encoded one by one they were ~100 calls of `len`, `append` and `encode` a request. Only for small
    arguments: a script passing rows (a beat's progress) would fill the cache with them."""
    num_keys = len(keys)
    return b"".join([b"*%d\r\n" % (3 + num_keys + len(args)), head, _bulk(b"%d" % num_keys),
                     *map(_key_bulk, keys), *map(_key_bulk, args)])


def _parse(buffer: bytearray, position: int):
    """One RESP2 reply at `position`: (value, next position). Raises _Incomplete."""
    line_end = buffer.find(b"\r\n", position)
    if line_end < 0:
        raise _Incomplete()
    kind, line = buffer[position], bytes(buffer[position + 1:line_end])
    position = line_end + 2
    if kind == 0x2B:  # + simple string
        return line.decode(), position
    if kind == 0x2D:  # - error
        message = line.decode()
        return (RedisUnavailable if says_unavailable(message) else RedisError)(message), position
    if kind == 0x3A:  # : integer
        return int(line), position
    if kind == 0x24:  # $ bulk string
        length = int(line)
        if length < 0:
            return None, position
        if len(buffer) < position + length + 2:
            raise _Incomplete()
        return bytes(buffer[position:position + length]).decode(), position + length + 2
    if kind == 0x2A:  # * array
        count = int(line)
        if count < 0:
            return None, position
        items = []
        for _ in range(count):
            item, position = _parse(buffer, position)
            items.append(item)
        return items, position
    raise RedisError(f"unexpected reply type {chr(kind)!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future] = deque()
        self.deadlines: deque[float] = deque()  # one per waiting future, in the same order
        self._watchdog: asyncio.TimerHandle | None = None
        self.buffer = bytearray()
        self.lost: Exception | None = None
        self.outgoing: list[bytes] = []  # commands of this loop iteration, written together

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        position = 0
        while position < len(self.buffer) and self.waiting:
            try:
                value, position_after = _parse(self.buffer, position)
            except _Incomplete:
                break
            position = position_after
            future = self.waiting.popleft()
            self.deadlines.popleft()
            if future.done():  # its caller was cancelled: the reply is not wanted
                continue
            if isinstance(value, (RedisError, RedisUnavailable)):
                future.set_exception(value)
            else:
                future.set_result(value)
        del self.buffer[:position]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(self.lost or ConnectionError(f"Redis connection lost: {exc or 'closed by the server'}"))

    def _fail_all(self, error: Exception) -> None:
        self.lost = error
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.deadlines.clear()
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)

    def _check_deadline(self) -> None:
        self._watchdog = None
        if not self.waiting:
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= self.deadlines[0]:
            # NOTE: later replies would answer the wrong callers once one is skipped: drop it all.
            if self.transport is not None:
                self.transport.abort()
            silent = RedisTimeout(f"Redis did not answer within {self.timeout_s:g} s")
            circuit.trip(silent)
            self._fail_all(silent)
            return
        self._watchdog = loop.call_at(self.deadlines[0], self._check_deadline)

    def call(self, *parts) -> asyncio.Future:
        return self.send(_encode(parts))

    def send(self, command: bytes) -> asyncio.Future:
        """`command`, already in RESP; the future of its reply."""
        future = asyncio.get_running_loop().create_future()
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            future.set_exception(self.lost or ConnectionError("Redis connection closed"))
            return future
        loop = future.get_loop()
        self.waiting.append(future)
        self.deadlines.append(loop.time() + self.timeout_s)
        if self._watchdog is None:
            self._watchdog = loop.call_at(self.deadlines[0], self._check_deadline)
        if not self.outgoing:
            future.get_loop().call_soon(self._write_outgoing)
        self.outgoing.append(command)
        return future

    def _write_outgoing(self) -> None:
        outgoing, self.outgoing = self.outgoing, []
        if self.lost is None and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(outgoing))


async def _open(url: str, timeout_s: float) -> _Protocol:
    try:
        return await asyncio.wait_for(_connect(url, timeout_s), timeout_s)
    except TimeoutError:
        silent = RedisTimeout(f"could not connect to Redis within {timeout_s:g} s")
        circuit.trip(silent)
        raise silent from None


async def _connect(url: str, timeout_s: float) -> _Protocol:
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss"):
        raise ValueError(f"unsupported Redis URL scheme {parsed.scheme!r}")
    loop = asyncio.get_running_loop()
    context = ssl.create_default_context() if parsed.scheme == "rediss" else None
    _, protocol = await loop.create_connection(lambda: _Protocol(timeout_s), parsed.hostname or "localhost",
                                               parsed.port or 6379, ssl=context)
    if parsed.password:
        credentials = [unquote(parsed.username), unquote(parsed.password)] if parsed.username else [unquote(parsed.password)]
        await protocol.call(b"AUTH", *credentials)
    database = (parsed.path or "/").lstrip("/")
    if database and database != "0":
        await protocol.call(b"SELECT", database)
    return protocol


class _Connection:
    """This loop's connection, opened on first use and again after a loss."""

    def __init__(self, url: str, timeout_s: float):
        self.url = url
        self.timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._opening: asyncio.Task | None = None

    async def protocol(self) -> _Protocol:
        current = self._protocol
        if current is not None and current.lost is None and not current.transport.is_closing():
            return current
        opening = self._opening
        if opening is None or opening.done():
            opening = self._opening = asyncio.ensure_future(_open(self.url, self.timeout_s))
        # NOTE: concurrent callers share one connection attempt; a failed one is retried by the next call.
        self._protocol = await asyncio.shield(opening)
        return self._protocol

    async def call(self, *parts):
        return await (await self.protocol()).call(*parts)

    def send(self, command: bytes) -> Awaitable:
        """The reply to `command` (in RESP), to await.

        NOTE: on a live connection (nearly every call) the reply's future itself, where two coroutines (this one and
        `protocol`) were started, awaited and ended around it, two scripts a request."""
        current = self._protocol
        if current is not None and current.lost is None and not current.transport.is_closing():
            return current.send(command)
        return self._send_once_open(command)

    async def _send_once_open(self, command: bytes):
        return await (await self.protocol()).send(command)

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()


_connections: PerLoop[_Connection] = PerLoop(lambda: _Connection(settings.REDIS_URL, settings.REDIS_TIMEOUT_S),
                                             close=_Connection.close)
