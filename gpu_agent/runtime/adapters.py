"""LoRA adapters in a running engine: load on demand, unload the least recently used when full.

One `AdapterSlots` per replica whose engine started with `--enable-lora`. It talks to vLLM's
runtime adapter API (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`, allowed by
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), so adapters come and go without restarting the engine.

The control plane says which adapters callers want (`AdapterSpec.wanted_at`, the last time a call
named one); `sync` keeps the `max_loras` most recently wanted ones loaded and reports what the
engine holds (`names`), most recently used first, for the heartbeat.

NOTE: the engine's own slot count (`--max-loras`) is the limit: we unload before we load, so the
engine never refuses a load for lack of a slot; and a load it refuses anyway (its shapes, its target
modules, a name it serves as its base model) loads what was unloaded for it again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx

from gpu_agent.protocol import AdapterSpec, ReplicaSpec, ReplicaState, ReplicaStatus
from gpu_agent.runtime import weights_formats
from gpu_agent.runtime.model_json import ModelJsonTooLarge, read_model_json
from gpu_agent.runtime.weights_access import StoreUnreachable, WeightsError

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0
# A load that failed for a passing reason is tried again after this long: no answer from the engine (unreachable, or
# slower than `LOAD_TIMEOUT_S`), the store unreachable (a Hub 5xx, an S3 timeout) or an I/O error fetching or staging
# the files (a disk full for a moment). A refusal (the engine's own reason, or the adapter's files) stands while the
# adapter does.
TRANSIENT_RETRY_S = 60.0


class AdapterLoadError(Exception):
    """The engine refused an adapter; the message is the engine's own reason."""


class AdapterUnanswered(AdapterLoadError):
    """No answer came (unreachable, or past the timeout): the engine may have loaded it or not."""


# What fails a load for a passing reason (`TRANSIENT_RETRY_S`).
_TRANSIENT = (AdapterUnanswered, StoreUnreachable, OSError)


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
        self._retry_at: dict[str, float] = {}  # adapter name -> when a failure for want of an answer is tried again

    def close(self) -> None:
        """Close its connections to the engine. NOTE: an httpx client let go is freed only by the cycle collector:
        each engine that restarted or ended kept its sockets open (and the engine's side of them) until then."""
        self._http.close()

    def names(self) -> list[str]:
        """Loaded adapters, most recently used first."""
        return list(reversed(self._loaded))

    def ensure(self, name: str, path: str | Path) -> None:
        """Make `name` loaded from `path` and the most recently used, unloading the least recently used if full.

        A load the engine refuses loads what was unloaded for it again, in its place in the LRU order."""
        path = str(path)
        if self._loaded.get(name) == path:
            self._loaded.move_to_end(name)
            return
        evicted: list[tuple[str, str]] = []  # least recently used first
        if name not in self._loaded:
            while len(self._loaded) >= self.max_loras:
                evicted.append(next(iter(self._loaded.items())))
                self.unload(evicted[-1][0])
        try:
            # NOTE: in place. The engine may hold the name already: adopted from a previous agent, or a load that
            # outlived its timeout; it answered 400 "already been loaded", kept as a failure until the engine
            # restarted. Or it holds another source under the name (an adapter deleted and created again).
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})
        except AdapterUnanswered:
            raise  # the engine may hold it now: its slots are full again, and the next sync reloads what is wanted
        except AdapterLoadError:
            # NOTE: before, any refusal the agent could not foresee cost the least recently used adapter its slot
            self._restore(evicted)
            raise
        self._loaded[name] = path
        self._loaded.move_to_end(name)
        self.failures.pop(name, None)
        logger.info("loaded adapter %s into %s", name, self.address)

    def _restore(self, evicted: list[tuple[str, str]]) -> None:
        for name, path in reversed(evicted):
            try:
                self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})
            except AdapterLoadError as exc:
                logger.warning("adapter %s not loaded again into %s: %s", name, self.address, exc)
                continue  # the next sync loads it if it is still wanted
            self._loaded[name] = path
            self._loaded.move_to_end(name, last=False)

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
        # A removed adapter's refusal goes with it: one created again under its name is tried afresh.
        self.failures = {name: reason for name, reason in self.failures.items() if name in known}
        now = time.monotonic()
        wanted = sorted((a for a in adapters if a.wanted_at > 0), key=lambda a: a.wanted_at, reverse=True)
        # Oldest first, so the most recently wanted ends as the most recently used.
        for adapter in reversed(wanted[: self.max_loras]):
            if (adapter.name in self.failures and adapter.name not in self._loaded
                    and now < self._retry_at.get(adapter.name, float("inf"))):
                continue  # NOTE: a load left unanswered was kept as a failure for good (every call a 503) before
            try:
                self.ensure(adapter.name, resolve(adapter))
                self._retry_at.pop(adapter.name, None)
            except (AdapterLoadError, WeightsError, ValueError, OSError) as exc:
                # NOTE: the messages of the first three carry no secrets; an OSError's may name a path, so only its
                # reason is shown
                reason = (f"reading the adapter failed: {exc.strerror or 'I/O error'}" if isinstance(exc, OSError)
                          else str(exc))
                if isinstance(exc, _TRANSIENT):
                    # NOTE: before, only a load left unanswered was: a Hub 5xx or a disk full for a moment failed the
                    # adapter endpoint-wide until its engine restarted
                    self._retry_at[adapter.name] = now + TRANSIENT_RETRY_S
                    retry = f" (tried again in {TRANSIENT_RETRY_S:.0f} s)"
                    self.failures[adapter.name] = reason[: 300 - len(retry)] + retry
                else:
                    self._retry_at.pop(adapter.name, None)
                    self.failures[adapter.name] = reason[:300]
                logger.warning("adapter %s not loaded: %s", adapter.name, exc)

    def retried(self) -> list[str]:
        """The failed adapters that are tried again (`TRANSIENT_RETRY_S`): their failure passes, the others stand."""
        return [name for name in self.failures if name in self._retry_at]

    def settled(self) -> set[str]:
        """The adapters a sync has nothing to do for now: loaded, or failed and not due to be tried again."""
        now = time.monotonic()
        return set(self._loaded) | {name for name in self.failures if now < self._retry_at.get(name, float("inf"))}

    def _post(self, path: str, body: dict) -> None:
        try:
            response = self._http.post(f"{self.address}{path}", json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise AdapterUnanswered(f"engine unreachable: {exc}") from exc
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


def adapter_problem(path: str | Path, max_lora_rank: int) -> str:
    """Why the engine would refuse this adapter folder, read from its files first ("" if none found).

    NOTE: checked before loading, because a load the engine refuses costs a reload: we unload the
    least recently used one to make room before the engine reads the files, and load it again after.
    """
    try:
        config = read_model_json(Path(path) / weights_formats.ADAPTER_CONFIG)
    except ModelJsonTooLarge as exc:
        return f"the adapter cannot be loaded: {exc}"
    except (OSError, ValueError, RecursionError):
        return weights_formats.NO_ADAPTER_CONFIG
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        return "the adapter is not a LoRA adapter (adapter_config.json peft_type)"
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        return "adapter_config.json declares no rank (r)"
    # NOTE: vLLM (`PEFTHelper.validate_legal`) refuses the largest of `r` and the per-module ranks of `rank_pattern`
    # past max_lora_rank; `alpha_pattern` scales, it sizes nothing. Checked here, before a slot is emptied for it.
    rank_pattern = config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        isinstance(value, int) and value >= 1 for value in rank_pattern.values()
    ):
        return "rank_pattern in adapter_config.json is not a map of module names to ranks"
    rank = max([rank, *rank_pattern.values()])
    if rank > max_lora_rank:
        return f"the adapter's rank {rank} is above the endpoint's max_lora_rank {max_lora_rank}"
    return weights_formats.adapter_problem(path)


class ReplicaAdapters:
    """The adapters of every READY replica on this node, synced in the background.

    `sync` is called with each desired spec (every heartbeat); a load runs on its own thread, so a
    heartbeat never waits for a download or the engine. `report` adds what each engine holds to
    the replica's status. An engine that restarted lost its adapters: its slots start empty again.
    """

    def __init__(
        self,
        fetch: Callable[[AdapterSpec], Path],
        *,
        wake: threading.Event | None = None,
        stage: Callable[[str, Path], Path] | None = None,
    ):
        self._fetch = fetch  # an adapter's local folder, downloaded if need be
        # Where a replica's engine reads a checked adapter from (`Supervisor.stage_adapter`: a confined engine
        # reads no folder of the weights cache but its model's).
        self._stage = stage
        self._wake = wake
        self._lock = threading.Lock()
        self._slots: dict[str, tuple[tuple[str, int], AdapterSlots]] = {}  # replica -> ((address, restarts), slots)
        self._syncing: set[str] = set()

    def sync(self, spec: ReplicaSpec, address: str, num_restarts: int) -> None:
        if not spec.max_loras or not address:
            return
        engine = (address, num_restarts)
        with self._lock:
            if spec.replica_id in self._syncing:
                return
            current = self._slots.get(spec.replica_id)
            if current is None or current[0] != engine:
                if current is not None:
                    current[1].close()  # its engine restarted: no sync uses them (`_syncing`)
                current = (engine, AdapterSlots(address, spec.engine_api_key, spec.max_loras))
                self._slots[spec.replica_id] = current
            slots = current[1]
            wanted = {a.name: a.wanted_at for a in spec.adapters if a.wanted_at > 0}
            loaded = set(slots.names())
            top = set(sorted(wanted, key=wanted.get, reverse=True)[: slots.max_loras])
            # NOTE: a failure due to be tried again is not settled: before, no thread ran for it, so it stood
            if top <= slots.settled() and loaded <= {a.name for a in spec.adapters}:
                return  # nothing to do: no thread
            self._syncing.add(spec.replica_id)
        threading.Thread(target=self._run, args=(spec, slots), name=f"adapters-{spec.replica_id}", daemon=True).start()

    def _run(self, spec: ReplicaSpec, slots: AdapterSlots) -> None:
        def resolve(adapter: AdapterSpec) -> Path:
            path = self._fetch(adapter)
            problem = adapter_problem(path, spec.max_lora_rank)
            if problem:
                raise ValueError(problem)
            # NOTE: as many copies as the engine holds adapters at once.
            return path if self._stage is None else self._stage(spec.replica_id, path, keep=spec.max_loras)

        try:
            slots.sync(spec.adapters, resolve)
        except Exception:  # NOTE: a sync must never kill the agent; the next heartbeat tries again
            logger.exception("replica %s: adapter sync failed", spec.replica_id)
        finally:
            with self._lock:
                self._syncing.discard(spec.replica_id)
                current = self._slots.get(spec.replica_id)
                if current is None or current[1] is not slots:
                    slots.close()  # its replica ended meanwhile (`report`)
            if self._wake is not None:
                self._wake.set()  # report the loaded adapters now: held calls wait for them

    def report(self, statuses: list[ReplicaStatus]) -> None:
        with self._lock:
            for replica_id in [r for r in self._slots if r not in {s.replica_id for s in statuses}]:
                _, slots = self._slots.pop(replica_id)
                if replica_id not in self._syncing:  # else that sync closes them when it ends (`_run`)
                    slots.close()
            for status in statuses:
                current = self._slots.get(status.replica_id)
                if current is not None and status.state == ReplicaState.READY:
                    status.adapters = current[1].names()
                    status.adapter_failures = dict(current[1].failures)
                    status.adapter_failures_retried = current[1].retried()
