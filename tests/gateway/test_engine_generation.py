"""Calls go only to replicas started with the configuration they were checked and reserved by
(`Endpoint.engine_generation`): a gateway's cached READY list may still name a replica a change just drained."""

import asyncio

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.gateway import directory, errors
from endpoints.gateway.directory import ReplicaInfo
from endpoints.models import Endpoint, Replica
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_call_checked_by_a_new_configuration_never_reaches_a_replica_of_the_old_one(gateway, tenant, start_mock_upstream):
    # The change has committed (a shorter context, a cheaper GPU type) and the replica is still READY in the
    # gateway's view: before, the call was served there, reserved by the new configuration (a 30k-token prompt on a
    # 32k engine reserved as 16 tokens after max_model_len went to 16).
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream, cold_start_timeout_s=2)
    Endpoint.objects.filter(pk=endpoint.pk).update(engine_generation=1)
    assert Replica.objects.get(endpoint=endpoint).engine_generation == 0

    answer = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {tenant.key}"},
                        json={"model": endpoint.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
                        timeout=30)

    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_capacity"  # waited for a new replica
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0
    assert not UsageRecord.objects.exists()


def test_a_replica_of_a_newer_configuration_than_the_calls_is_a_503_to_retry(monkeypatch):
    # The call's endpoint was read just before a change, and its replicas have been replaced since: neither the old
    # configuration's reservation on the new engine, nor a wait for replicas of a configuration that is gone.
    async def cached(endpoint_id, *, fresh=False, fresh_since=None):
        return [ReplicaInfo("r-new", "http://127.0.0.1:1", generation=3)]

    monkeypatch.setattr(directory._replicas, "get", cached)
    assert asyncio.run(directory.ready_replicas("e", generation=3))[0].id == "r-new"
    with pytest.raises(errors.OpenAIError) as refused:
        asyncio.run(directory.ready_replicas("e", generation=2))
    assert refused.value.status == 503
    assert asyncio.run(directory.ready_replicas("e"))[0].id == "r-new"  # the batch runner's count of slots
