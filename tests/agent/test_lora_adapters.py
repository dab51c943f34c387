"""LoRA on the agent side without an engine: the engine flags an endpoint with adapter slots gets (on
CPU and on the CUDA path alike), the checks read from an adapter's files before a load, and the
reports an engine that restarted (and so lost its adapters) gives."""

import errno
import gc
import http.server
import json
import threading

import httpx
import pytest

from gpu_agent.protocol import AdapterSpec, ModelTask, ReplicaState, ReplicaStatus
from gpu_agent.runtime import adapters as adapters_module
from gpu_agent.runtime.adapters import AdapterSlots, ReplicaAdapters, adapter_problem
from gpu_agent.runtime.engine import build_engine_command
from gpu_agent.runtime.model_json import MAX_MODEL_JSON_BYTES
from gpu_agent.runtime.tiny_model import build_tiny_lora_adapter
from gpu_agent.runtime.weights_access import StoreUnreachable

from .conftest import make_spec, wait_until, with_peak_memory, write_json_of_empty_objects


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_an_endpoint_with_adapter_slots_starts_its_engine_with_lora_on_every_device():
    for device in ("cpu", "cuda"):
        command = build_engine_command(make_spec(max_loras=4, max_lora_rank=32), "/m", port=1, device=device)
        assert "--enable-lora" in command.argv
        assert (flag(command.argv, "--max-loras"), flag(command.argv, "--max-lora-rank")) == ("4", "32")
        assert command.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_an_endpoint_without_slots_or_an_embedding_one_starts_without_lora():
    assert "--enable-lora" not in build_engine_command(make_spec(), "/m", port=1, device="cpu").argv
    embed = make_spec(max_loras=2, task=ModelTask.EMBED)
    assert "--enable-lora" not in build_engine_command(embed, "/m", port=1, device="cpu").argv


def test_an_adapter_above_the_rank_limit_or_without_a_peft_config_is_refused_before_loading(tmp_path):
    build_tiny_lora_adapter(tmp_path / "rank16", rank=16)
    assert adapter_problem(tmp_path / "rank16", 8) == "the adapter's rank 16 is above the endpoint's max_lora_rank 8"
    assert adapter_problem(tmp_path / "rank16", 16) == ""
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json" in adapter_problem(tmp_path / "empty", 16)


def test_an_adapter_whose_rank_pattern_passes_the_rank_limit_is_refused_before_loading(tmp_path):
    """vLLM refuses the largest of `r` and `rank_pattern`'s ranks past max_lora_rank: before, only `r` was checked,
    and the load it then refused had unloaded the endpoint's least recently used adapter first."""
    adapter = build_tiny_lora_adapter(tmp_path / "patterned", rank=8)
    config_path = adapter / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "rank_pattern": {"q_proj": 4096}, "alpha_pattern": {"q_proj": 9999}}))
    assert adapter_problem(adapter, 16) == "the adapter's rank 4096 is above the endpoint's max_lora_rank 16"
    config_path.write_text(json.dumps({**config, "rank_pattern": {"q_proj": 16}, "alpha_pattern": {"q_proj": 9999}}))
    assert adapter_problem(adapter, 16) == ""
    config_path.write_text(json.dumps({**config, "rank_pattern": {"q_proj": "4096"}}))
    assert adapter_problem(adapter, 16) == "rank_pattern in adapter_config.json is not a map of module names to ranks"


def test_an_adapter_whose_weights_are_a_pickle_is_refused_before_loading(tmp_path):
    """Before, a folder with `adapter_model.bin` and no safetensors went to the engine, whose adapter loader reads
    it with torch.load (a pickle can run code when it is read)."""
    adapter = build_tiny_lora_adapter(tmp_path / "pickled", rank=8)
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    assert "adapter_model.safetensors" in adapter_problem(adapter, 16)


def test_an_adapter_config_past_the_size_cap_is_refused_unread(tmp_path):
    (tmp_path / "huge").mkdir()
    write_json_of_empty_objects(tmp_path / "huge" / "adapter_config.json", {"peft_type": "LORA", "r": 8})
    problem, peak = with_peak_memory(lambda: adapter_problem(tmp_path / "huge", 16))
    assert problem == "the adapter cannot be loaded: its adapter_config.json is larger than 4 MiB"
    assert peak < MAX_MODEL_JSON_BYTES


def test_a_replica_not_ready_or_unknown_reports_no_adapters():
    keeper = ReplicaAdapters(lambda adapter: tmp_path_never_used(adapter))
    spec = make_spec(max_loras=2, adapters=[AdapterSpec(name="tone", source="/a/tone")])
    keeper.sync(spec, "http://127.0.0.1:9", 0)  # nothing wanted yet: no load, no thread
    statuses = [ReplicaStatus(replica_id=spec.replica_id, state=ReplicaState.STARTING)]
    keeper.report(statuses)
    assert statuses[0].adapters == [] and statuses[0].adapter_failures == {}


def tmp_path_never_used(adapter):
    raise AssertionError(f"{adapter.name} was fetched though nobody wanted it")


class _LoRAEngine:
    """vLLM's adapter endpoints as they answer (`vllm.entrypoints.openai.models.serving`): a name already loaded is a
    400 unless loaded in place."""

    def __init__(self, loaded: dict[str, str] | None = None):
        self.loaded = dict(loaded or {})

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        name = body["lora_name"]
        if request.url.path == "/v1/load_lora_adapter":
            if name in self.loaded and not body.get("load_inplace"):
                return httpx.Response(400, json={"error": {"message": f"The lora adapter '{name}' has already been "
                                                                      "loaded."}})
            self.loaded[name] = body["lora_path"]
            return httpx.Response(200, text="Success")
        self.loaded.pop(name, None)
        return httpx.Response(200, text="Success")


def test_an_adapter_the_engine_holds_already_is_loaded_again_not_failed_and_a_new_source_replaces_the_old():
    # An engine adopted from a previous agent holds its adapters: loading one again was a 400 "already been loaded",
    # kept as a failure (503 adapter_loading for every call naming it) until the engine restarted. An adapter deleted
    # and created again under its name with another source kept serving the old weights.
    engine = _LoRAEngine({"tone": "/cache/tone-v1"})
    slots = AdapterSlots("http://engine", "key", max_loras=2, client=httpx.Client(transport=httpx.MockTransport(engine)))

    slots.sync([AdapterSpec(name="tone", source="s3://b/tone", wanted_at=1.0)], lambda adapter: "/cache/tone-v1")
    assert slots.names() == ["tone"] and slots.failures == {}

    slots.ensure("tone", "/cache/tone-v2")
    assert engine.loaded == {"tone": "/cache/tone-v2"} and slots.names() == ["tone"]


def test_a_load_left_unanswered_is_tried_again_and_a_refusal_is_not(monkeypatch):
    # A load that outlived its timeout (the engine finished it anyway) was kept as a failure for good: every call
    # naming the adapter a 503 until the engine restarted.
    engine, times_out, refused = _LoRAEngine(), {"slow"}, []

    def answer(request: httpx.Request) -> httpx.Response:
        name = json.loads(request.content)["lora_name"]
        if name in times_out:
            times_out.discard(name)
            engine(request)  # loaded, and the answer never came
            raise httpx.ReadTimeout("timed out", request=request)
        if name == "bad":
            refused.append(name)
            return httpx.Response(400, json={"error": {"message": "LoRA rank 64 is greater than max_lora_rank 16."}})
        return engine(request)

    clock = [1000.0]
    monkeypatch.setattr(adapters_module.time, "monotonic", lambda: clock[0])
    slots = AdapterSlots("http://engine", "key", max_loras=2, client=httpx.Client(transport=httpx.MockTransport(answer)))
    wanted = [AdapterSpec(name="slow", source="s3://b/slow", wanted_at=2.0),
              AdapterSpec(name="bad", source="s3://b/bad", wanted_at=1.0)]
    slots.sync(wanted, lambda adapter: f"/cache/{adapter.name}")
    assert set(slots.failures) == {"slow", "bad"} and slots.names() == []
    assert slots.retried() == ["slow"]  # reported so: the control plane holds calls for it, and refuses "bad"

    clock[0] += adapters_module.TRANSIENT_RETRY_S + 1
    slots.sync(wanted, lambda adapter: f"/cache/{adapter.name}")
    assert slots.names() == ["slow"] and set(slots.failures) == {"bad"} and refused == ["bad"]


@pytest.mark.parametrize("transient", [
    StoreUnreachable("cannot reach the Hub for hf:acme/tone (it answered 503)"),
    OSError(errno.ENOSPC, "No space left on device"),
    StoreUnreachable(f"cannot reach the store of s3://{'b' * 63}/{'tone/' * 80}"),
], ids=["store-unreachable", "disk-full", "long-reason"])
def test_a_fetch_that_failed_for_a_passing_reason_is_tried_again_with_the_reason_shown_meanwhile(monkeypatch, transient):
    # A Hub 5xx or an S3 timeout, or a disk full for a moment while staging, was kept as an engine's refusal is: the
    # adapter FAILED endpoint-wide until its engine restarted, its batch lines 400 adapter_failed.
    clock = [1000.0]
    monkeypatch.setattr(adapters_module.time, "monotonic", lambda: clock[0])
    engine = _LoRAEngine()
    slots = AdapterSlots("http://engine", "key", max_loras=2, client=httpx.Client(transport=httpx.MockTransport(engine)))
    wanted = [AdapterSpec(name="tone", source="hf:acme/tone", wanted_at=1.0)]
    failures = [transient]

    def resolve(adapter):
        if failures:
            raise failures.pop()
        return "/cache/tone"

    slots.sync(wanted, resolve)
    assert slots.names() == [] and slots.failures["tone"].endswith("(tried again in 60 s)")
    assert len(slots.failures["tone"]) <= 300
    assert "tone" in slots.settled()  # not before its time: a failing store is not asked at every heartbeat
    clock[0] += adapters_module.TRANSIENT_RETRY_S + 1
    assert "tone" not in slots.settled()
    slots.sync(wanted, resolve)
    assert slots.names() == ["tone"] and slots.failures == {} and engine.loaded == {"tone": "/cache/tone"}


def test_a_node_tries_a_passing_failure_again_at_a_later_heartbeat(monkeypatch, tmp_path):
    # The heartbeat's sync started no load while every wanted adapter was loaded or failed: a failure due to be tried
    # again stood all the same.
    monkeypatch.setattr(adapters_module, "TRANSIENT_RETRY_S", 0.0)
    engine = _KeepAliveLoRAEngine()
    adapter = build_tiny_lora_adapter(tmp_path / "tone", rank=8)
    failures = [StoreUnreachable("cannot reach the store of s3://b/tone")]

    def fetch(_adapter):
        if failures:
            raise failures.pop()
        return adapter

    synced = threading.Event()  # set as each sync's thread ends
    keeper = ReplicaAdapters(fetch, wake=synced)
    spec = make_spec(max_loras=1, adapters=[AdapterSpec(name="tone", source="s3://b/tone", wanted_at=1.0)])
    try:
        keeper.sync(spec, engine.address, 0)
        assert synced.wait(10) and _reported_failures(keeper, spec.replica_id)
        statuses = [ReplicaStatus(replica_id=spec.replica_id, state=ReplicaState.READY)]
        keeper.report(statuses)
        assert statuses[0].adapter_failures_retried == ["tone"]  # before: not said, so the failure stood
        keeper.sync(spec, engine.address, 0)  # the next heartbeat
        wait_until(lambda: _reported_adapters(keeper, spec.replica_id) == ["tone"], 10)
        assert _reported_failures(keeper, spec.replica_id) == {}
    finally:
        keeper.report([])
        engine.stop()


def _reported_failures(keeper: ReplicaAdapters, replica_id: str) -> dict[str, str]:
    statuses = [ReplicaStatus(replica_id=replica_id, state=ReplicaState.READY)]
    keeper.report(statuses)
    return statuses[0].adapter_failures


def test_a_load_the_engine_refuses_costs_no_other_adapter_its_slot():
    # The least recently used adapter was unloaded to make room, then the engine refused the new one (its shapes or
    # target modules, or the name it serves its base model under): the working adapter was gone, and a caller of it
    # waited for a load.
    def answer(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["lora_name"] == "llama":
            return httpx.Response(400, json={"error": {"message": "The lora adapter 'llama' conflicts with a served "
                                                                  "base model."}})
        return engine(request)

    engine = _LoRAEngine()
    slots = AdapterSlots("http://engine", "key", max_loras=2, client=httpx.Client(transport=httpx.MockTransport(answer)))
    tone, terse = (AdapterSpec(name=name, source=f"s3://b/{name}", wanted_at=1.0) for name in ("tone", "terse"))
    slots.sync([tone, terse], lambda adapter: f"/cache/{adapter.name}")
    # llama and tone are the two most recently wanted: terse is unloaded for llama
    slots.sync([tone, terse, AdapterSpec(name="llama", source="s3://b/llama", wanted_at=2.0)],
               lambda adapter: f"/cache/{adapter.name}")
    assert "conflicts with a served base model" in slots.failures["llama"]
    assert engine.loaded == {"tone": "/cache/tone", "terse": "/cache/terse"}
    assert slots.names() == ["tone", "terse"]  # terse is back, still the first out


def test_the_adapters_of_engines_that_restarted_or_ended_leave_no_connection_open(tmp_path):
    """Each replica's loads go through a client of its own, replaced when its engine restarts and dropped when the
    replica ends. Let go unclosed, it kept its connections to the engine open until the cycle collector ran: one more
    open socket on both sides for every replica with adapters the node ever ran."""
    engine = _KeepAliveLoRAEngine()
    adapter = build_tiny_lora_adapter(tmp_path / "tone", rank=8)
    keeper = ReplicaAdapters(lambda _adapter: adapter)
    gc.collect()
    gc.disable()  # NOTE: as between two of its runs in a long-lived agent: nothing frees what is only unreferenced
    try:
        for index in range(5):
            spec = make_spec(f"r-{index}", max_loras=1,
                             adapters=[AdapterSpec(name="tone", source="s3://b/tone", wanted_at=1.0)])
            for num_restarts in (0, 1):  # its engine restarts once, then the replica ends
                keeper.sync(spec, engine.address, num_restarts)
                wait_until(lambda replica_id=spec.replica_id: _reported_adapters(keeper, replica_id) == ["tone"], 10)
            keeper.report([])
        assert engine.num_loads == 10
        # the engine sees each connection closed soon after the agent closes it; before, all 10 stayed open
        wait_until(lambda: engine.num_open_connections() == 0, 10)
    finally:
        gc.enable()
        engine.stop()


def _reported_adapters(keeper: ReplicaAdapters, replica_id: str) -> list[str]:
    statuses = [ReplicaStatus(replica_id=replica_id, state=ReplicaState.READY)]
    keeper.report(statuses)
    return statuses[0].adapters


class _KeepAliveLoRAEngine:
    """vLLM's load route on loopback, over HTTP/1.1 keep-alive as uvicorn serves it; counts its open connections."""

    def __init__(self):
        self.num_loads = 0
        self._open = 0
        self._lock = threading.Lock()
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_):
                pass

            def setup(self):
                super().setup()
                with engine._lock:
                    engine._open += 1

            def finish(self):
                super().finish()
                with engine._lock:
                    engine._open -= 1

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with engine._lock:
                    engine.num_loads += 1
                self.send_response(200)
                self.send_header("Content-Length", "7")
                self.end_headers()
                self.wfile.write(b"Success")

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def num_open_connections(self) -> int:
        with self._lock:
            return self._open

    def stop(self):
        self._server.shutdown()
        self._server.server_close()
