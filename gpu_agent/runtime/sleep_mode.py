"""vLLM sleep mode as a scale-to-zero level on GPUs: an idle replica sleeps instead of stopping.

A sleeping engine (level 1) has offloaded its weights to host memory and freed its KV cache, so it
holds (almost) no GPU memory and is billed as zero, and `POST /wake_up` brings it back in about a
second instead of a cold start. vLLM serves `/sleep`, `/wake_up` and `/is_sleeping` only when the
engine runs with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1` (`vllm/entrypoints/serve/dev/
sleep/api_router.py`), and sleep mode needs CUDA (CuMemAllocator): it is never used on CPU nodes.

This module owns the decisions (`SleepPolicy`: when an idle replica sleeps, when a sleeping one
wakes), the engine flags (`sleep_mode_flags`) and the HTTP calls (`EngineSleepClient`).

NOTE: unrun on a GPU here (the development machine has none): the decisions and the HTTP calls are
tested against a fake engine (`tests/agent/test_sleep_mode.py`); the supervisor, the control plane's
billing (a sleeping replica billed as zero) and the gateway's wake-up on a held request are not
wired to it yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from gpu_agent.runtime.engine import DEVICE_CPU

SLEEP_MODE_FLAG = "--enable-sleep-mode"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM mounts the sleep routes only with this set
SLEEP_LEVEL_OFFLOAD_WEIGHTS = 1  # weights to host memory, KV cache dropped; level 2 drops weights too


def sleep_mode_flags(device: str, enabled: bool) -> tuple[list[str], dict[str, str]]:
    """Engine arguments and environment for an endpoint that may sleep; nothing on CPU or when off."""
    if not enabled or device == DEVICE_CPU:
        return [], {}
    return [SLEEP_MODE_FLAG], {DEV_MODE_ENV: "1"}


@dataclass(slots=True)
class SleepPolicy:
    """When a READY replica on a GPU goes to sleep, and when a sleeping one wakes."""

    idle_after_s: float = 60.0  # no request running or waiting for this long: sleep
    level: int = SLEEP_LEVEL_OFFLOAD_WEIGHTS

    def __post_init__(self) -> None:
        if self.idle_after_s <= 0:
            raise ValueError("idle_after_s must be positive")
        if self.level not in (1, 2):
            raise ValueError("level must be 1 or 2")

    def should_sleep(
        self, *, device: str, enabled: bool, sleeping: bool, num_running: int, num_waiting: int, idle_for_s: float
    ) -> bool:
        return (
            enabled
            and device != DEVICE_CPU
            and not sleeping
            and num_running == 0
            and num_waiting == 0
            and idle_for_s >= self.idle_after_s
        )

    def should_wake(self, *, sleeping: bool, num_held_requests: int) -> bool:
        return sleeping and num_held_requests > 0


class EngineSleepError(RuntimeError):
    """The engine refused or failed a sleep-mode call (its status and body are in the message)."""


class EngineSleepClient:
    """The HTTP calls to one engine's sleep routes, with the replica's engine key."""

    def __init__(self, address: str, api_key: str = "", *, timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=address, headers=headers, timeout=timeout_s)

    def sleep(self, level: int = SLEEP_LEVEL_OFFLOAD_WEIGHTS) -> None:
        self._call("POST", "/sleep", params={"level": level})

    def wake_up(self) -> bool:
        """Wake every part (weights and KV cache); True once the engine says it is fully awake."""
        return self._call("POST", "/wake_up").get("status") == "awake"

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping").get("is_sleeping"))

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineSleepError(f"{method} {path}: {exc!r}") from exc
        if response.status_code != 200:
            raise EngineSleepError(f"{method} {path}: HTTP {response.status_code}: {response.text[:200]}")
        try:
            return response.json()
        except ValueError:
            return {}
