"""An adapter's source is fetched as the engine reads it: its config and safetensors weights only, within the node's
bound for adapters, refused before any byte is fetched otherwise. Before, the whole prefix was fetched, whatever it
held, and made room for itself by evicting other tenants' cached models."""

# ruff: noqa: F811  (the fixtures imported are parameters of the tests)
from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import httpx
import pytest

from gpu_agent.protocol import AdapterSpec
from gpu_agent.runtime import cli
from gpu_agent.runtime.adapters import AdapterSlots, adapter_problem
from gpu_agent.runtime.reconciler import Reconciler
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import SourceAccess, WeightsError

from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)

CONFIG = json.dumps({"peft_type": "LORA", "r": 8}).encode()


def _upload(s3, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    s3.create_bucket(Bucket=bucket)
    for name, body in files.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body, ACL="public-read")


def _victim(s3, cache: WeightsCache):
    """Another organisation's model, cached and unpinned (the first to go when a fetch needs room)."""
    _upload(
        s3,
        "victim",
        "m",
        {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(20_000)},
    )
    return cache.fetch("s3://victim/m", access=SourceAccess(scope="org-1"))


def _fetch_as_the_agent_does(cache: WeightsCache, source: str):
    """The folder the agent hands the engine for an adapter of org-2's."""
    spec = AdapterSpec(name="a", source=source, credentials=None, weights_scope="org-2", wanted_at=1.0)
    no_engines = SimpleNamespace(stage_adapter=lambda replica_id, source, keep=None: source)
    return Reconciler(no_engines, cache, wake=threading.Event())._fetch_adapter(spec)


def test_an_adapter_beside_padding_is_fetched_without_it_and_evicts_no_other_tenants_model(
    s3,
    s3_endpoint,
    tmp_path,
):
    cache = WeightsCache(tmp_path / "weights", budget_bytes=90_000, s3_endpoint_url=s3_endpoint)
    victim = _victim(s3, cache)
    _upload(
        s3,
        "attacker",
        "a",
        {
            "adapter_config.json": CONFIG,
            "adapter_model.safetensors": b"x" * 100,
            "padding.dat": os.urandom(60_000),
            "more.safetensors": os.urandom(10_000),
            "tokenizer.json": b"{}",
            "sub/adapter_model.safetensors": b"x",
        },
    )

    path = _fetch_as_the_agent_does(cache, "s3://attacker/a")

    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert adapter_problem(path, 16) == ""
    assert victim.exists() and (victim / "model.safetensors").stat().st_size == 20_000


def test_an_adapter_past_the_nodes_bound_is_refused_before_any_byte_is_fetched(s3, s3_endpoint, tmp_path):
    cache = WeightsCache(
        tmp_path / "weights", budget_bytes=200_000, s3_endpoint_url=s3_endpoint, adapter_max_bytes=50_000
    )
    victim = _victim(s3, cache)
    _upload(
        s3,
        "attacker",
        "big",
        {"adapter_config.json": CONFIG, "adapter_model.safetensors": os.urandom(60_000)},
    )

    with pytest.raises(WeightsError) as refused:
        _fetch_as_the_agent_does(cache, "s3://attacker/big")

    assert str(refused.value) == "the adapter's files are 60 kB; this node loads adapters of at most 50 kB"
    assert cache.num_downloads == 1  # the victim's only
    assert [s.source for s in cache.statuses()] == ["s3://victim/m"] and victim.exists()
    assert not any((tmp_path / "weights" / ".tmp").iterdir())


def test_a_tenants_adapters_make_room_among_themselves_before_evicting_another_tenants_model(
    s3, s3_endpoint, tmp_path
):
    """An organisation's cached adapters take at most `ADAPTER_SHARE` times the bound for one: cycling through
    adapters within the bound, a tenant evicted other tenants' models with each new one."""
    cache = WeightsCache(
        tmp_path / "weights", budget_bytes=140_000, s3_endpoint_url=s3_endpoint, adapter_max_bytes=30_000
    )
    victim = _victim(s3, cache)
    paths = []
    # Each adapter is charged 24 kB on disk (its config at least 4 kB), the victim too: five are past the share of
    # 4 x 30 kB, and past the budget beside the victim; four are within both.
    for number in range(5):
        files = {"adapter_config.json": CONFIG, "adapter_model.safetensors": os.urandom(20_000)}
        _upload(s3, "tenant", f"a{number}", files)
        paths.append(_fetch_as_the_agent_does(cache, f"s3://tenant/a{number}"))

    assert victim.exists()
    assert [path.exists() for path in paths] == [False, True, True, True, True]  # the tenant's oldest went


def test_the_refusal_is_the_adapters_failure_reason_and_no_load_is_tried(s3, s3_endpoint, tmp_path):
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint, adapter_max_bytes=1_000)
    _upload(
        s3, "attacker", "big", {"adapter_config.json": CONFIG, "adapter_model.safetensors": os.urandom(5_000)}
    )
    loads = []
    engine = httpx.Client(
        transport=httpx.MockTransport(lambda request: loads.append(request) or httpx.Response(200))
    )
    slots = AdapterSlots("http://engine", "key", max_loras=2, client=engine)

    slots.sync(
        [AdapterSpec(name="a", source="s3://attacker/big", weights_scope="org-2", wanted_at=1.0)],
        lambda adapter: _fetch_as_the_agent_does(cache, adapter.source),
    )

    assert slots.failures == {"a": "the adapter's files are 5 kB; this node loads adapters of at most 1 kB"}
    assert loads == [] and cache.num_downloads == 0


def test_an_adapter_source_without_its_config_or_safetensors_weights_is_refused_unfetched(
    s3,
    s3_endpoint,
    tmp_path,
):
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    _upload(s3, "tenant", "no-config", {"adapter_model.safetensors": b"x" * 100, "padding.dat": b"y" * 5_000})
    _upload(s3, "tenant", "pickled", {"adapter_config.json": CONFIG, "adapter_model.bin": b"x" * 100})

    with pytest.raises(WeightsError, match="no readable adapter_config.json"):
        _fetch_as_the_agent_does(cache, "s3://tenant/no-config")
    with pytest.raises(WeightsError, match=r"PyTorch pickle files \(adapter_model.bin\)"):
        _fetch_as_the_agent_does(cache, "s3://tenant/pickled")
    assert cache.num_downloads == 0


def test_a_source_fetched_as_an_adapter_and_as_a_model_is_cached_apart(s3, s3_endpoint, tmp_path):
    """A Hub commit fingerprints a model's files and an adapter's alike: without the kind in the key, a model
    fetched after an adapter of the same source would have been given the adapter's two files."""
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    _upload(s3, "tenant", "both", {"adapter_config.json": CONFIG, "adapter_model.safetensors": b"x" * 100})

    adapter = _fetch_as_the_agent_does(cache, "s3://tenant/both")
    model = cache.fetch("s3://tenant/both", access=SourceAccess(scope="org-2"))

    assert adapter != model and cache.num_downloads == 2


def test_the_agents_bound_for_adapters_is_set_on_its_command_line_or_environment(monkeypatch):
    assert cli._parser().parse_args(["run", "--control-plane", "http://cp"]).adapter_max_gb is None
    monkeypatch.setenv("INFERPLANE_AGENT_ADAPTER_MAX_GB", "0.5")
    assert cli._parser().parse_args(["run", "--control-plane", "http://cp"]).adapter_max_gb == 0.5
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["run", "--control-plane", "http://cp", "--adapter-max-gb", "0"])
