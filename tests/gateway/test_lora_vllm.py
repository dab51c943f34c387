"""LoRA adapters on a real vLLM CPU engine (vLLM 0.32's CPU backend serves LoRA).

The engine starts as the agent starts it for an endpoint with `max_loras` (`--enable-lora
--max-loras 2 --max-lora-rank 8`, runtime loading allowed). The agent's `AdapterSlots` load and
unload adapters through vLLM's own API, least recently used out first, without restarting it. End
to end: an adapter created through the API answers the `openai` client as `"<endpoint>:<adapter>"`
on the base endpoint's replica, loaded on first use while the call is held; its usage row names it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.adapters import record_replica_adapters
from endpoints.fleet.services import replica_spec
from endpoints.models import Adapter, Replica
from gpu_agent.protocol import ReplicaSpec, ReplicaState, ReplicaStatus
from gpu_agent.runtime.adapters import AdapterLoadError, AdapterSlots, ReplicaAdapters
from gpu_agent.runtime.tiny_model import build_tiny_lora_adapter
from tests.engines import serve_engine
from tests.gateway.conftest import serve_endpoint
from tests.processes import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

ENGINE_KEY = "key-of-the-lora-engine"
MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
def lora_engine(engine_node, tiny_model_dir) -> str:
    spec = ReplicaSpec(replica_id="lora-engine", endpoint_id="lora", served_model_name="tiny-lora",
                       model_source=str(tiny_model_dir), max_model_len=512, max_num_seqs=8,
                       engine_api_key=ENGINE_KEY, max_loras=2, max_lora_rank=MAX_LORA_RANK)
    with serve_engine(engine_node, spec, tiny_model_dir) as replica:
        assert "--enable-lora" in replica.command.argv
        yield replica.address


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, engine_node, lora_engine) -> Path:
    """The adapters where the engine reads them: staged in its own folder, as the agent stages each it loads
    (`Supervisor.stage_adapter`); a confined engine reads no other folder of the node but its model's."""
    root = tmp_path_factory.mktemp("adapters")
    for number in (1, 2, 3):
        build_tiny_lora_adapter(root / f"a{number}", seed=number)
    build_tiny_lora_adapter(root / "rank16", rank=16)
    staged = [engine_node.stage_adapter("lora-engine", root / name) for name in ("a1", "a2", "a3", "rank16")]
    return staged[0].parent


def engine_models(address: str) -> set[str]:
    answer = httpx.get(f"{address}/v1/models", headers={"Authorization": f"Bearer {ENGINE_KEY}"}, timeout=30)
    return {model["id"] for model in answer.json()["data"]}


def test_the_agent_loads_adapters_on_demand_and_unloads_the_least_recently_used_when_full(lora_engine, adapters_dir):
    slots = AdapterSlots(lora_engine, ENGINE_KEY, max_loras=2)
    slots.ensure("a1", adapters_dir / "a1")
    slots.ensure("a2", adapters_dir / "a2")
    slots.ensure("a1", adapters_dir / "a1")  # a1 used again: a2 is now the least recently used
    slots.ensure("a3", adapters_dir / "a3")
    assert slots.names() == ["a3", "a1"]
    assert engine_models(lora_engine) >= {"a1", "a3"} and "a2" not in engine_models(lora_engine)
    for name in slots.names():
        slots.unload(name)
    assert not engine_models(lora_engine) & {"a1", "a2", "a3"}


def test_a_new_agent_loads_an_adapter_the_engine_already_holds(lora_engine, adapters_dir):
    # The agent that adopts an engine does not know its adapters: vLLM answered its load with a 400 "already been
    # loaded", kept as the adapter's failure until the engine restarted. Loaded in place, it is the same adapter.
    AdapterSlots(lora_engine, ENGINE_KEY, max_loras=2).ensure("a1", adapters_dir / "a1")
    adopting = AdapterSlots(lora_engine, ENGINE_KEY, max_loras=2)
    adopting.ensure("a1", adapters_dir / "a1")
    adopting.ensure("a1", adapters_dir / "a2")  # its source changed: the engine now holds the other weights
    assert adopting.names() == ["a1"] and "a1" in engine_models(lora_engine)
    adopting.unload("a1")
    assert "a1" not in engine_models(lora_engine)


def test_the_engine_refuses_an_adapter_above_its_max_lora_rank_with_its_own_reason(lora_engine, adapters_dir):
    slots = AdapterSlots(lora_engine, ENGINE_KEY, max_loras=2)
    with pytest.raises(AdapterLoadError, match="greater than max_lora_rank"):
        slots.ensure("rank16", adapters_dir / "rank16")


def test_a_load_the_engine_refuses_leaves_the_adapters_it_held_loaded(lora_engine, adapters_dir):
    # An adapter named as the engine's served model name is refused ("conflicts with a served base model"): before, the
    # least recently used adapter was unloaded first and stayed so.
    slots = AdapterSlots(lora_engine, ENGINE_KEY, max_loras=2)
    slots.ensure("a1", adapters_dir / "a1")
    slots.ensure("a2", adapters_dir / "a2")
    with pytest.raises(AdapterLoadError, match="conflicts with a served base model"):
        slots.ensure("tiny-lora", adapters_dir / "a3")
    assert slots.names() == ["a2", "a1"] and engine_models(lora_engine) >= {"a1", "a2"}
    for name in slots.names():
        slots.unload(name)


def test_an_adapter_created_through_the_api_answers_the_openai_client_on_the_base_endpoints_replica(
    gateway, tenant, lora_engine, adapters_dir
):
    endpoint = serve_endpoint(tenant.org, lora_engine, name="tiny-lora", engine_key=ENGINE_KEY,
                              max_loras=2, max_lora_rank=MAX_LORA_RANK)
    replica = Replica.objects.get(endpoint=endpoint)
    created = httpx.post(f"{gateway}/api/v1/endpoints/{endpoint.pk}/adapters/", timeout=30,
                         headers={"Authorization": f"Bearer {tenant.key}"},
                         json={"name": "tone", "source": str(adapters_dir / "a1"), "rank": 4})
    assert created.status_code == 201, created.text
    assert created.json()["model"] == "tiny-lora:tone"

    # The node's agent, as its heartbeats run it: desired spec in, loaded adapters reported back.
    agent = ReplicaAdapters(lambda adapter: Path(adapter.source))
    stop = threading.Event()

    def heartbeats():
        while not stop.wait(0.2):
            agent.sync(replica_spec(Replica.objects.select_related("endpoint", "node").get(pk=replica.pk)),
                       lora_engine, 0)
            report = ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.READY, address=lora_engine)
            agent.report([report])
            record_replica_adapters(replica.node, report)

    thread = threading.Thread(target=heartbeats, daemon=True)
    thread.start()
    try:
        client = tenant.client(gateway, timeout=300)
        assert "tiny-lora:tone" in {model.id for model in client.models.list()}
        prompt = [{"role": "user", "content": "hello world how are you"}]
        tuned = client.chat.completions.create(model="tiny-lora:tone", messages=prompt, max_tokens=8, temperature=0)
        base = client.chat.completions.create(model="tiny-lora", messages=prompt, max_tokens=8, temperature=0)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert tuned.usage.completion_tokens > 0
    assert tuned.choices[0].message.content != base.choices[0].message.content  # the adapter's weights answered
    assert Adapter.objects.get(name="tone").state == "READY"
    # Usage rows are written after the answer (the gateway's ledger writer): wait for both.
    wait_until(lambda: UsageRecord.objects.filter(adapter="tone").count() == 1, 60, message="the adapter's usage row")
    wait_until(lambda: UsageRecord.objects.filter(adapter="").count() == 1, 60, message="the base model's usage row")
