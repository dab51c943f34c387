"""vLLM sleep mode as a scale-to-zero level on GPUs: an idle replica sleeps instead of stopping.

A sleeping engine (level 1) has offloaded its weights to host memory and freed its KV cache, so it
holds (almost) no GPU memory and is billed as zero, and `POST /wake_up` brings it back in about a
second instead of a cold start. vLLM serves `/sleep`, `/wake_up` and `/is_sleeping` only when the
engine runs with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1` (`vllm/entrypoints/serve/dev/
sleep/api_router.py`), and sleep mode needs CUDA (CuMemAllocator): it is never used on CPU nodes
(`engine.build_engine_command` adds the flags to CUDA engines only).

This module owns the engine flags (`sleep_mode_flags`) and the HTTP calls (`EngineSleepClient`).
When a replica sleeps, wakes or stops for good is the control plane's decision (`endpoints.scheduler`,
the endpoint's `idle_action`), sent as the replica's action (`ReplicaAction.SLEEP` / `RUN`); the
supervisor makes these calls (`Supervisor.sleep`, `Supervisor.wake`).

NOTE: unrun on a GPU here (the development machine has none): the calls are tested against a fake
engine (`tests/agent/test_sleep_mode.py`, `tests/agent/fake_engine.py`); `bench/gpu_check_sleep.py`
runs the real engine on CUDA.
"""

from __future__ import annotations

SLEEP_MODE_FLAG = "--enable-sleep-mode"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM mounts the sleep routes only with this set
SLEEP_LEVEL_OFFLOAD_WEIGHTS = 1  # weights to host memory, KV cache dropped; level 2 drops weights too


def sleep_mode_flags(enabled: bool) -> tuple[list[str], dict[str, str]]:
    """Engine arguments and environment for a CUDA engine that may sleep; nothing when off."""
    if not enabled:
        return [], {}
    return [SLEEP_MODE_FLAG], {DEV_MODE_ENV: "1"}


class EngineSleepError(RuntimeError):
    """The engine refused or failed a sleep-mode call (its status and body are in the message)."""


class EngineSleepClient:
    """The HTTP calls to one engine's sleep routes, with the replica's engine key."""

    def __init__(self, address: str, api_key: str = "", *, timeout_s: float = 30.0) -> None:
        # NOTE: imported here, not at the top: `engine` imports this module for its flags and stays
        # standard-library only for the control plane (`tests/agent/test_runtime_imports.py`).
        import httpx

        self._http_error = httpx.HTTPError
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
        except self._http_error as exc:
            raise EngineSleepError(f"{method} {path}: {exc!r}") from exc
        if response.status_code != 200:
            raise EngineSleepError(f"{method} {path}: HTTP {response.status_code}: {response.text[:200]}")
        try:
            return response.json()
        except ValueError:
            return {}
