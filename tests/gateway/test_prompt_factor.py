"""An endpoint whose prompts ran past their bound is reserved higher from then on (`endpoints.models.PromptFactor`).

The factor's store (only ever raised; of two writers the larger stands; per copy of the model), what the gateway's
cached endpoint reads of it, the estimate's multiplication for every kind, and staff's view and reset. A real engine's
case (a template that repeats message text) is `test_prompt_factor_vllm.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import httpx
import pytest
from django.db import connections

from billing.ledger import cost_of
from billing.models import UsageRecord
from billing.services import set_spend_cap
from controlplane import worker_threads
from controlplane.accounts.models import ApiKey, AuditEvent
from controlplane.accounts.services import SYSTEM, Actor
from endpoints import services
from endpoints.gateway import call, directory, estimate
from endpoints.gateway.request import InferenceRequest
from endpoints.models import Endpoint, PromptFactor, Replica, prompt_factor_for
from tests.conftest import wait_until
from tests.factories import EndpointFactory, UserFactory, sign_in_staff
from tests.gateway.conftest import serve_endpoint
from tests.outages import database_refusing_connections

CONTEXT = 4096
CHAT = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "%" * 240}]}


def _info(factor: Decimal | None = None) -> directory.EndpointInfo:
    return directory.EndpointInfo(
        id="e",
        name="m",
        organization_id=1,
        paused=False,
        max_model_len=CONTEXT,
        cold_start_timeout_s=60,
        price_input_per_million=Decimal(1),
        price_cached_input_per_million=Decimal(1),
        price_output_per_million=Decimal(1),
        created_at=0.0,
        max_held_requests=8,
        prompt_factor=factor,
        model_copy=("hf:org/m", ""),
    )


def _bounds(kind: str, payload: dict, factor: Decimal | None) -> tuple[int, ...]:
    return InferenceRequest(kind, "/v1/x", b"", payload).worst_case(_info(factor)).prompt_bounds


# --- the estimate ---------------------------------------------------------------------------------


def test_the_factor_a_request_teaches_is_its_prompt_over_its_bound_rounded_up_to_an_eighth():
    # 5.99: the reviewer's template, 240 bytes
    assert prompt_factor_for(1942, (324,), CONTEXT) == Decimal("6")
    assert prompt_factor_for(1944, (324,), CONTEXT) == Decimal("6")
    assert prompt_factor_for(1945, (324,), CONTEXT) == Decimal("6.125")
    assert prompt_factor_for(325, (324,), CONTEXT) == Decimal("1.125")
    assert prompt_factor_for(10**9, (1,), CONTEXT) == Decimal(2**20)  # bounded


@pytest.mark.parametrize(
    ("kind", "payload", "num_prompt_tokens"),
    [
        # "Hello" really 2,000 tokens beside a prompt whose bound is the context already, really 4,090
        ("embedding", {"model": "m", "input": ["Hello", "%" * 5000]}, 2000 + 4090),
        ("completion", {"model": "m", "prompt": ["Hello", "%" * 5000], "max_tokens": 1}, 2000 + 4090),
        # the capped one only reached at the factor: 1,000 of "%" reach the context at ~4.1×
        ("completion", {"model": "m", "prompt": ["Hello", "%" * 1000], "max_tokens": 1}, 3000 + 1000),
        # past every context
        ("embedding", {"model": "m", "input": ["%" * 5000, "%" * 6000]}, 2 * CONTEXT + 1),
    ],
)
def test_the_factor_a_prompt_list_teaches_covers_it_though_a_bound_is_at_the_context(
    kind, payload, num_prompt_tokens
):
    unscaled = InferenceRequest(kind, "/v1/x", b"", payload).worst_case(_info(None))
    assert num_prompt_tokens > unscaled.num_prompt_tokens

    factor = prompt_factor_for(num_prompt_tokens, unscaled.prompt_bounds, CONTEXT)
    scaled = InferenceRequest(kind, "/v1/x", b"", payload).worst_case(_info(factor))

    # before: the ratio of the totals (1.5 for the first: 1,974 tokens of every such call unreserved, for ever)
    assert scaled.num_prompt_tokens >= min(num_prompt_tokens, len(scaled.prompt_bounds) * CONTEXT)
    assert scaled.unscaled_prompt_bounds == unscaled.prompt_bounds
    # within an eighth of the least that covers it (each bound is rounded up)
    smaller = factor - Decimal(2) / 8
    assert factor == Decimal(2**20) or (
        InferenceRequest(kind, "/v1/x", b"", payload).worst_case(_info(smaller)).num_prompt_tokens
        < num_prompt_tokens
    )


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        ("chat", CHAT),
        ("completion", {"model": "m", "prompt": ["%" * 100, "%" * 200]}),
        ("responses", {"model": "m", "max_output_tokens": 1, "input": "%" * 240}),
        ("embedding", {"model": "m", "input": ["%" * 100, "%" * 10]}),
    ],
)
def test_every_kinds_prompt_bounds_are_multiplied_by_the_endpoints_factor_rounded_up(kind, payload):
    plain = _bounds(kind, payload, None)
    assert plain == estimate.worst_case(payload, kind, CONTEXT).prompt_bounds  # no factor: as estimated

    scaled = _bounds(kind, payload, Decimal("2.125"))

    assert scaled == tuple(-(-bound * 17 // 8) for bound in plain)


def test_a_factor_past_the_context_reserves_the_whole_context_and_no_more():
    case = InferenceRequest("chat", "/v1/x", b"", CHAT).worst_case(_info(Decimal(1000)))
    assert case.prompt_bounds == (CONTEXT,)
    assert case.unscaled_prompt_bounds == estimate.worst_case(CHAT, "chat", CONTEXT).prompt_bounds


# --- the store ------------------------------------------------------------------------------------


def _raise(endpoint: Endpoint, factor: str) -> bool:
    return PromptFactor.raise_to(endpoint.pk, endpoint.model_source, endpoint.weights_scope, Decimal(factor))


@pytest.mark.django_db
def test_a_factor_is_only_ever_raised_and_the_gateways_endpoint_reads_it():
    endpoint = EndpointFactory()
    assert directory._endpoint_info(endpoint).prompt_factor is None

    assert _raise(endpoint, "2.5")
    assert not _raise(endpoint, "1.5")  # a smaller one changes nothing
    assert not _raise(endpoint, "2.5")

    assert endpoint.prompt_factor == Decimal("2.5")
    assert directory._endpoint_info(endpoint).prompt_factor == Decimal("2.5")
    assert (
        directory._endpoint_info(endpoint, for_calls=False).prompt_factor is None
    )  # `/v1/models` reserves nothing


@pytest.mark.django_db(transaction=True)
def test_of_two_writers_racing_the_larger_factor_stands():
    for attempt in range(10):
        endpoint = EndpointFactory()
        factors = ["3", "2"] if attempt % 2 else ["2", "3"]
        start = threading.Barrier(len(factors))

        def write(factor, endpoint=endpoint, start=start):
            try:
                start.wait()
                _raise(endpoint, factor)
            finally:
                connections.close_all()

        writers = [threading.Thread(target=write, args=(factor,)) for factor in factors]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join()

        assert PromptFactor.objects.get(endpoint=endpoint).factor == Decimal(3)


@pytest.mark.django_db
def test_another_model_or_revision_starts_fresh_and_the_old_ones_factor_is_kept_for_it():
    endpoint = EndpointFactory(model_source="hf:org/model@v1")
    _raise(endpoint, "4")

    Endpoint.objects.filter(pk=endpoint.pk).update(model_source="hf:org/model@v2")
    endpoint.refresh_from_db()

    assert endpoint.prompt_factor is None
    assert directory._endpoint_info(endpoint).prompt_factor is None
    assert PromptFactor.objects.filter(endpoint=endpoint, model_source="hf:org/model@v1").exists()


@pytest.mark.django_db
def test_a_deleted_endpoint_learns_no_factor():
    endpoint = EndpointFactory()
    Endpoint.objects.filter(pk=endpoint.pk).update(deleted_at="2026-01-01T00:00:00Z")

    assert not _raise(endpoint, "3")
    assert not PromptFactor.objects.exists()


@pytest.mark.django_db
def test_a_gateway_process_keeps_its_own_factor_at_once_only_for_the_copy_it_learned_it_on():
    endpoint = EndpointFactory()
    info = directory._endpoint_info(endpoint)
    key = (info.organization_id, info.name)
    directory._endpoints.entries[key] = (0.0, info)
    try:
        directory.keep_prompt_factor(info, Decimal(3))
        assert directory._endpoints.entries[key][1].prompt_factor == Decimal(3)
        directory.keep_prompt_factor(info, Decimal(2))  # never lowered
        assert directory._endpoints.entries[key][1].prompt_factor == Decimal(3)

        moved = directory.EndpointInfo(
            **{**{name: getattr(info, name) for name in info.__slots__}, "model_copy": ("hf:other/model", "")}
        )
        directory.keep_prompt_factor(moved, Decimal(5))  # learned on the model the endpoint served before
        assert directory._endpoints.entries[key][1].prompt_factor == Decimal(3)
    finally:
        directory._endpoints.forget(key)


def _cached(info: directory.EndpointInfo) -> tuple[float, directory.EndpointInfo]:
    return directory._endpoints.entries[(info.organization_id, info.name)]


def _reload(info: directory.EndpointInfo, *, kept_while_loading: Decimal | None) -> directory.EndpointInfo:
    """A reload of the endpoint's cached entry, which this process keeps `kept_while_loading` during (None: before)."""

    async def scenario():
        loading = asyncio.ensure_future(
            directory._endpoints._reload((info.organization_id, info.name), (info.organization_id, info.name))
        )
        await asyncio.sleep(0)  # the reload has started: it reads the database in a worker thread
        if kept_while_loading is not None:
            directory.keep_prompt_factor(info, kept_while_loading)
        return await loading

    try:
        return asyncio.run(scenario())
    finally:
        connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_a_reload_started_before_the_factor_was_kept_lands_with_what_it_read_and_keeps_the_higher_factor():
    endpoint = EndpointFactory()
    info = directory._endpoint_info(endpoint)
    key = (info.organization_id, info.name)
    directory._endpoints.entries[key] = (0.0, info)
    try:
        Endpoint.objects.filter(pk=endpoint.pk).update(
            price_input_per_million=Decimal(7)
        )  # staff set a price

        _reload(info, kept_while_loading=Decimal(3))

        # before: the keep stamped the entry as loaded now, the reload was dropped, the old price served ~2 s more
        stamped_at, cached = _cached(info)
        assert stamped_at > 0.0
        assert cached.price_input_per_million == Decimal(7)
        assert cached.prompt_factor == Decimal(3)  # the reload read no row: the factor kept here stands
    finally:
        directory._endpoints.forget(key)


@pytest.mark.django_db(transaction=True)
def test_keeping_a_factor_leaves_the_entrys_time_and_a_reload_started_after_takes_the_databases_factor():
    endpoint = EndpointFactory()
    info = directory._endpoint_info(endpoint)
    key = (info.organization_id, info.name)
    directory._endpoints.entries[key] = (12.5, info)
    try:
        directory.keep_prompt_factor(info, Decimal(3))
        assert _cached(info)[0] == 12.5  # before: stamped now, as if loaded now
        _raise(endpoint, "4")  # another process learned more

        assert _reload(info, kept_while_loading=None).prompt_factor == Decimal(4)

        PromptFactor.objects.filter(endpoint=endpoint).delete()  # staff reset it
        assert _reload(info, kept_while_loading=None).prompt_factor is None
        assert _cached(info)[1].prompt_factor is None
    finally:
        directory._endpoints.forget(key)


# --- staff ----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_staff_see_the_learned_factor_in_the_admin_and_reset_it_with_an_audited_action(client):
    endpoint = EndpointFactory()
    _raise(endpoint, "6.125")
    sign_in_staff(client, UserFactory(is_staff=True, is_superuser=True))

    page = client.get(f"/django-admin/endpoints/endpoint/{endpoint.pk}/change/").content.decode()
    assert "6.125×" in page

    response = client.post(
        "/django-admin/endpoints/endpoint/",
        {"action": "reset_prompt_factor", "_selected_action": [str(endpoint.pk)]},
    )

    assert response.status_code == 302
    assert endpoint.prompt_factor is None
    audit = AuditEvent.objects.get(action="endpoint.prompt_factor_reset", target_id=str(endpoint.pk))
    assert list(audit.details["factors"].values()) == ["6.125"]


# --- through the gateway (an engine that reports a fixed prompt: `tests.fakes.mock_openai`) ---------

PRICE = Decimal("100")
HELLO = {"prompt": "Hello", "max_tokens": 1}  # bounded at 13 prompt tokens


def _served(tenant, address: str) -> Endpoint:
    return serve_endpoint(
        tenant.org,
        address,
        price_input_per_million=PRICE,
        price_cached_input_per_million=PRICE,
        price_output_per_million=PRICE,
    )


def _completion(gateway: str, tenant, endpoint: Endpoint) -> UsageRecord:
    response = httpx.post(
        f"{gateway}/v1/completions",
        json={"model": endpoint.name, **HELLO},
        headers={"Authorization": f"Bearer {tenant.key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text[:300]
    return wait_until(
        lambda: UsageRecord.objects.filter(request_id=response.headers["x-request-id"]).first(),
        15,
        message="the usage row",
    )


def _in_full(endpoint: Endpoint, row: UsageRecord) -> Decimal:
    return cost_of(endpoint, row.prompt_tokens, row.cached_tokens, row.completion_tokens)


@pytest.mark.django_db(transaction=True)
def test_a_tenant_escalating_step_by_step_loses_the_platform_at_most_one_reservation_a_step(
    gateway, tenant, start_mock_upstream
):
    endpoint = _served(tenant, start_mock_upstream(prompt_tokens=40))
    replica = endpoint.replicas.get()
    for step, num_prompt_tokens in enumerate((40, 100, 400)):
        if step:  # the tenant's prompts grow past the factor learned so far
            Replica.objects.filter(pk=replica.pk).update(
                address=start_mock_upstream(prompt_tokens=num_prompt_tokens)
            )
        first = wait_until(
            lambda n=num_prompt_tokens: (
                (row := _completion(gateway, tenant, endpoint)).prompt_tokens == n and row
            ),
            30,
            message="a call at the next step",
        )
        assert first.cost < _in_full(endpoint, first)  # this step's loss: billed its reservation
        wait_until(
            lambda n=num_prompt_tokens: (
                (PromptFactor.of(endpoint) or 0) >= prompt_factor_for(n, (13,), endpoint.max_model_len)
            ),
            15,
            message="the step's factor",
        )

        again = _completion(gateway, tenant, endpoint)

        assert again.prompt_tokens == num_prompt_tokens
        assert again.cost == _in_full(endpoint, again)


@pytest.mark.django_db(transaction=True)
def test_calls_past_the_bound_before_the_factor_lands_each_lose_at_most_their_reservation(
    gateway, tenant, start_mock_upstream
):
    endpoint = _served(tenant, start_mock_upstream(prompt_tokens=100, prefill_ms=300))
    reserved = estimate.worst_case(HELLO, "completion", endpoint.max_model_len).max_cost(endpoint)
    with ThreadPoolExecutor(8) as pool:
        rows = list(pool.map(lambda _: _completion(gateway, tenant, endpoint), range(8)))

    assert all(row.prompt_tokens == 100 and row.cost <= reserved for row in rows)
    factor = wait_until(lambda: PromptFactor.of(endpoint), 15, message="the learned factor")
    assert factor == prompt_factor_for(100, (13,), endpoint.max_model_len) == Decimal("7.75")
    assert PromptFactor.objects.filter(endpoint=endpoint).count() == 1
    after = _completion(gateway, tenant, endpoint)
    assert after.cost == _in_full(endpoint, after)


@pytest.mark.django_db(transaction=True)
def test_a_prompt_list_with_a_prompt_at_the_context_is_billed_in_full_from_the_call_after_the_first_past_it(
    gateway, tenant, start_mock_upstream
):
    # "Hello" (bound 13) really 1,505 tokens beside a prompt whose bound is the context (2,048) already: 3,553 in all.
    # Before, the factor was the ratio of the totals (1.75), which the capped bound never follows: every call stayed
    # ~42 % unbilled, for ever.
    endpoint = _served(tenant, start_mock_upstream(prompt_tokens=3553))
    body = {"model": endpoint.name, "prompt": ["Hello", "%" * 3000], "max_tokens": 1}
    billed_in_full_at = None
    for step in range(3):
        response = httpx.post(
            f"{gateway}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {tenant.key}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text[:300]
        row = wait_until(
            lambda response=response: UsageRecord.objects.filter(
                request_id=response.headers["x-request-id"]
            ).first(),
            15,
            message="the usage row",
        )
        if row.cost == _in_full(endpoint, row):
            billed_in_full_at = step
            break
        wait_until(lambda: PromptFactor.of(endpoint), 15, message="the learned factor")

    assert billed_in_full_at == 1  # one call lost its reservation's worth, the next was billed in full


@pytest.mark.django_db(transaction=True)
def test_a_factor_staff_reset_is_learned_again_by_the_gateway_that_wrote_it_before(
    gateway, tenant, start_mock_upstream
):
    endpoint = _served(tenant, start_mock_upstream(prompt_tokens=100))
    _completion(gateway, tenant, endpoint)
    wait_until(lambda: PromptFactor.of(endpoint), 15, message="the learned factor")
    staff = UserFactory(is_staff=True, is_superuser=True)
    assert services.reset_prompt_factor(Actor(user=staff), endpoint) == 1

    # the gateway reserves as estimated again once it reloads the endpoint: the next call past the bound loses
    wait_until(
        lambda: (row := _completion(gateway, tenant, endpoint)).cost < _in_full(endpoint, row),
        30,
        message="a call past the bound after the reset",
    )

    # before: never written again by the process that had written it (every second call lost ~86 %)
    assert wait_until(lambda: PromptFactor.of(endpoint), 15, message="the factor learned again") == Decimal(
        "7.75"
    )
    after = _completion(gateway, tenant, endpoint)
    assert after.cost == _in_full(endpoint, after)


# --- what a tenant and an operator are told --------------------------------------------------------

FACTOR_NOTE = "Prompts at this endpoint are reserved 100× their estimate since a prompt ran past it; staff can reset it."


def _refused(gateway: str, tenant, endpoint: Endpoint) -> httpx.Response:
    return httpx.post(
        f"{gateway}/v1/completions",
        json={"model": endpoint.name, **HELLO},
        headers={"Authorization": f"Bearer {tenant.key}"},
        timeout=60,
    )


@pytest.mark.django_db(transaction=True)
def test_a_request_too_large_for_the_keys_tokens_per_minute_says_the_learned_factor_made_it_so(
    gateway, tenant, start_mock_upstream
):
    endpoint = _served(tenant, start_mock_upstream(prompt_tokens=5))
    ApiKey.objects.filter(pk=tenant.api_key.pk).update(tokens_per_minute=500)
    _raise(endpoint, "100")  # "Hello" (bound 13) reserves 1,300 tokens

    response = _refused(gateway, tenant, endpoint)

    assert response.status_code == 429 and "retry-after" not in response.headers
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert error["message"].startswith("Request too large")
    assert error["message"].endswith(FACTOR_NOTE)


@pytest.mark.django_db(transaction=True)
def test_a_call_refused_for_its_cost_says_the_learned_factor_made_it_so(gateway, tenant, start_mock_upstream):
    endpoint = _served(tenant, start_mock_upstream(prompt_tokens=5))
    set_spend_cap(
        SYSTEM, tenant.org, spend_cap=Decimal("0.05")
    )  # "Hello" reserves ~0.0014 $, at 100× ~0.13 $
    _raise(endpoint, "100")

    response = _refused(gateway, tenant, endpoint)

    assert response.status_code == 402
    error = response.json()["error"]
    assert error["code"] == "insufficient_quota" and error["message"].endswith(FACTOR_NOTE)


@pytest.mark.django_db(transaction=True)
def test_a_factor_rising_past_eight_is_logged_as_a_warning(caplog):
    endpoint = EndpointFactory()
    info = directory._endpoint_info(endpoint)
    try:
        with caplog.at_level(logging.WARNING, logger=call.logger.name):
            asyncio.run(call._write_prompt_factor(info, Decimal(8)))
            assert "past 8×" not in caplog.text
            asyncio.run(call._write_prompt_factor(info, Decimal("8.125")))
    finally:
        connections.close_all()

    assert endpoint.prompt_factor == Decimal("8.125")
    assert f"endpoint {endpoint.pk}: its prompt factor rose to 8.125×, past 8×" in caplog.text


@contextlib.contextmanager
def _a_loop_of_its_own():
    """An event loop the test steps through, each worker thread's PostgreSQL session closed as it ends (as
    `worker_threads.run_briefly` does), so none is left open for the teardown."""
    loop = asyncio.new_event_loop()
    kept = worker_threads._RunConnections()
    token = worker_threads._run_connections.set(kept)
    try:
        yield loop
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
        worker_threads._run_connections.reset(token)
        kept.close_all()
        connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_a_factor_learned_while_postgresql_refuses_connections_is_written_once_it_is_back(monkeypatch):
    # Before: the write's failure was logged alone, and the factor this process kept went with the endpoint's next
    # reload once PostgreSQL was back: the next call past the bound lost its reservation again.
    monkeypatch.setattr(call, "PROMPT_FACTOR_RETRY_S", 0.05, raising=False)
    endpoint = EndpointFactory()
    info = directory._endpoint_info(endpoint)
    with _a_loop_of_its_own() as loop:
        with database_refusing_connections():
            loop.run_until_complete(call._write_prompt_factor(info, Decimal(3)))
            # a smaller one: the larger stands
            loop.run_until_complete(call._write_prompt_factor(info, Decimal(2)))
            loop.run_until_complete(asyncio.sleep(0.3))  # tried again meanwhile: refused too
            assert endpoint.prompt_factor is None

        factor = wait_until(
            lambda: loop.run_until_complete(asyncio.sleep(0.05)) or endpoint.prompt_factor,
            15,
            message="the factor written once PostgreSQL is back",
        )

        assert factor == Decimal(3)
        assert not directory.unwritten_prompt_factors


@pytest.mark.django_db(transaction=True)
def test_an_endpoint_reloaded_once_postgresql_is_back_keeps_the_factor_not_written_yet(monkeypatch):
    # Before: the first reload read no factor row and dropped the factor this process kept until the retry wrote it.
    monkeypatch.setattr(call, "PROMPT_FACTOR_RETRY_S", 3600)  # the retry comes after the reload
    monkeypatch.setattr(directory, "unwritten_prompt_factors", {})
    endpoint = EndpointFactory()
    key = (endpoint.organization_id, endpoint.name)
    with _a_loop_of_its_own() as loop:
        info = loop.run_until_complete(directory.find_endpoint(*key))
        directory.keep_prompt_factor(info, Decimal(3))  # as `_learn_prompt_factor` does at once
        with database_refusing_connections():
            assert loop.run_until_complete(call._write_prompt_factor(info, Decimal(3))) is False

        reloaded = loop.run_until_complete(directory._endpoints.get(key, *key, fresh=True))

        assert endpoint.prompt_factor is None  # not written yet
        assert reloaded.prompt_factor == Decimal(3)
        # another copy of its model (a new revision) is not reserved for the old copy's factor
        other_copy = dataclasses.replace(reloaded, model_copy=("hf:another/model", ""), prompt_factor=None)
        assert directory._keep_learned_factor(None, other_copy, 0.0).prompt_factor is None
        call._retrying_prompt_factors.cancel()


def test_factors_kept_unwritten_past_their_bound_drop_the_oldest_and_keep_the_largest_per_copy(monkeypatch):
    monkeypatch.setattr(directory, "MAX_UNWRITTEN_PROMPT_FACTORS", 2)
    monkeypatch.setattr(directory, "unwritten_prompt_factors", {})
    first, second, third = (dataclasses.replace(_info(), id=name) for name in ("first", "second", "third"))

    async def outage():
        for info, factor in ((first, 2), (second, 3), (second, 2), (third, 4)):
            call._keep_unwritten_prompt_factor(info, Decimal(factor))
        call._retrying_prompt_factors.cancel()

    asyncio.run(outage())

    kept = {key[0]: factor for key, (_, factor) in directory.unwritten_prompt_factors.items()}
    assert kept == {"second": Decimal(3), "third": Decimal(4)}
