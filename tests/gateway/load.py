"""Steady client traffic against a live gateway while a test breaks something under it.

Each answer is sorted as a user sees it: `ok` (with the request id and the usage the client got),
`clean` (an error in OpenAI's shape that is not a 500), `broken` (anything else: a 500, a stream cut
without an error event, a body that is not JSON) or `hung` (no answer within the client timeout:
the hang detector).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

MESSAGES = [{"role": "user", "content": "Hello"}]


@dataclass
class Answer:
    outcome: str  # ok | clean | broken | hung
    status: int | None = None
    request_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    detail: str = ""
    at: float = field(default_factory=time.monotonic)


def call_once(client: httpx.Client, base_url: str, key: str, model: str, *, stream: bool, max_tokens: int) -> Answer:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    try:
        with client.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
            request_id = response.headers.get("x-request-id")
            if response.status_code != 200:
                try:
                    error = json.loads(response.read())["error"]
                    outcome = "broken" if response.status_code == 500 else "clean"
                    return Answer(outcome, response.status_code, request_id, detail=error.get("code") or "")
                except (ValueError, KeyError, TypeError):
                    return Answer("broken", response.status_code, request_id, detail=response.text[:200])
            if not stream:
                usage = json.loads(response.read())["usage"]
                return Answer("ok", 200, request_id, usage["prompt_tokens"], usage["completion_tokens"])
            usage, done, error = None, False, None
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"].get("code")
                    elif chunk.get("usage"):
                        usage = chunk["usage"]
            if error is not None:
                return Answer("clean", 200, request_id, detail=f"stream error {error}")
            if not done or usage is None:
                return Answer("broken", 200, request_id, detail="stream ended without [DONE] or usage")
            return Answer("ok", 200, request_id, usage["prompt_tokens"], usage["completion_tokens"])
    except httpx.TimeoutException as exc:
        return Answer("hung", detail=repr(exc))
    except httpx.HTTPError as exc:
        return Answer("broken", detail=repr(exc))


class Load:
    """`num_clients` threads calling in a loop, alternately streaming and not, until `stop()`."""

    def __init__(self, base_url: str, key: str, model: str, *, num_clients: int = 4, timeout_s: float = 15,
                 max_tokens: int = 4):
        self.base_url, self.key, self.model = base_url, key, model
        self.timeout_s, self.max_tokens = timeout_s, max_tokens
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(index,), daemon=True) for index in range(num_clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 5)

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            number = index
            while not self._stopping.is_set():
                answer = call_once(client, self.base_url, self.key, self.model, stream=number % 2 == 1,
                                   max_tokens=self.max_tokens)
                with self._lock:
                    self.answers.append(answer)
                number += 1
                if answer.outcome != "ok":
                    time.sleep(0.05)

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)

    def outcomes(self) -> Counter:
        return Counter(answer.outcome for answer in self.snapshot())

    def num_since(self, moment: float, outcome: str = "ok", detail: str | None = None) -> int:
        return sum(1 for answer in self.snapshot()
                   if answer.outcome == outcome and answer.at > moment and (detail is None or answer.detail == detail))

    def num_ok_since(self, moment: float) -> int:
        return sum(1 for answer in self.snapshot() if answer.outcome == "ok" and answer.at > moment)
