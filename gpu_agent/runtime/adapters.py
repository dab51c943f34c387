"""LoRA adapters in a running engine: load on demand, unload the least recently used when full.

One `AdapterSlots` per replica whose engine started with `--enable-lora`. It talks to vLLM's
runtime adapter API (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`, allowed by
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), so adapters come and go without restarting the engine.

The control plane says which adapters callers want (`AdapterSpec.wanted_at`, the last time a call
named one); `sync` keeps the `max_loras` most recently wanted ones loaded and reports what the
engine holds (`names`), most recently used first, for the heartbeat.

NOTE: the engine's own slot count (`--max-loras`) is the limit: we unload before we load, so the
engine never refuses a load for lack of a slot.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx

from gpu_agent.protocol import AdapterSpec

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0


class AdapterLoadError(Exception):
    """The engine refused an adapter; the message is the engine's own reason."""


class AdapterSlots:
    def __init__(self, address: str, engine_api_key: str, max_loras: int, *, client: httpx.Client | None = None):
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.address = address.rstrip("/")
        self.max_loras = max_loras
        self._headers = {"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}
        self._http = client or httpx.Client(timeout=LOAD_TIMEOUT_S)
        self._loaded: collections.OrderedDict[str, str] = collections.OrderedDict()  # name -> path, LRU first
        self.failures: dict[str, str] = {}  # adapter name -> why the engine refused it

    def names(self) -> list[str]:
        """Loaded adapters, most recently used first."""
        return list(reversed(self._loaded))

    def ensure(self, name: str, path: str | Path) -> None:
        """Make `name` loaded and the most recently used, unloading the least recently used if full."""
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        while len(self._loaded) >= self.max_loras:
            self.unload(next(iter(self._loaded)))
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        self._loaded[name] = str(path)
        self.failures.pop(name, None)
        logger.info("loaded adapter %s into %s", name, self.address)

    def unload(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name})
        self._loaded.pop(name, None)
        logger.info("unloaded adapter %s from %s", name, self.address)

    def sync(self, adapters: Iterable[AdapterSpec], resolve: Callable[[AdapterSpec], str | Path]) -> None:
        """Load the most recently wanted adapters (at most `max_loras`); forget removed ones.

        `resolve` gives an adapter's local folder (downloading it if need be). An adapter the engine
        refuses is remembered in `failures` with the engine's reason and not tried again this sync.
        """
        adapters = list(adapters)
        known = {adapter.name for adapter in adapters}
        for name in [name for name in self._loaded if name not in known]:
            self.unload(name)
        wanted = sorted((a for a in adapters if a.wanted_at > 0), key=lambda a: a.wanted_at, reverse=True)
        # Oldest first, so the most recently wanted ends as the most recently used.
        for adapter in reversed(wanted[: self.max_loras]):
            if adapter.name in self.failures and adapter.name not in self._loaded:
                continue
            try:
                self.ensure(adapter.name, resolve(adapter))
            except (AdapterLoadError, OSError, ValueError) as exc:
                self.failures[adapter.name] = str(exc)[:300]
                logger.warning("adapter %s not loaded: %s", adapter.name, exc)

    def _post(self, path: str, body: dict) -> None:
        try:
            response = self._http.post(f"{self.address}{path}", json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise AdapterLoadError(f"engine unreachable: {exc}") from exc
        if response.status_code >= 400:
            raise AdapterLoadError(_engine_reason(response))


def _engine_reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or f"HTTP {response.status_code}"
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]
