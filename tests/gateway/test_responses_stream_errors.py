"""A `/v1/responses` stream that fails mid-way ends as the Responses API ends one: an `error` event (`type`, `code`,
`message`, `param`, `sequence_number` after the last event sent), then the stream's end, which the openai client's
stream helper (`client.responses.stream`) yields as a `ResponseErrorEvent`. Whether the gateway ends it (its replica
lost) or the engine does (vLLM writes its failure in its chat streams' shape, `{"error": {…}}`)."""

from __future__ import annotations

import pytest
from openai.types.responses import ResponseErrorEvent

from tests.fakes import responses_engine
from tests.gateway.conftest import serve_endpoint

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def engine(scripted_responses_engine):
    """The scripted Responses engine (`tests.fakes.responses_engine`)."""
    return scripted_responses_engine


def _events(gateway: str, tenant, endpoint, scenario: str) -> list:
    with tenant.client(gateway).responses.stream(model=endpoint.name, input="hi", max_output_tokens=1000,
                                                 metadata={"scenario": scenario, "whole": "1"}) as stream:
        return list(stream)


def _assert_ends_with_an_error_event(events: list, code: str) -> None:
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) == responses_engine.NUM_DELTAS
    error = events[-1]
    assert isinstance(error, ResponseErrorEvent), error
    assert (error.type, error.code, error.param) == ("error", code, None) and error.message
    assert error.sequence_number == deltas[-1].sequence_number + 1


def test_a_stream_whose_replica_dies_mid_way_ends_with_the_responses_apis_error_event(gateway, tenant, engine):
    # Before: `data: {"error": …}`, a chat stream's error: the openai client raised an APIError of no known type
    # instead of yielding the event, and the deltas it had yielded were all the caller had.
    endpoint = serve_endpoint(tenant.org, engine)
    _assert_ends_with_an_error_event(_events(gateway, tenant, endpoint, "dies"), "upstream_error")


def test_an_engines_error_in_its_chat_shape_reaches_the_client_as_the_responses_apis_error_event(
        gateway, tenant, engine):
    # Before: relayed as vLLM wrote it (`{"error": {…}}` with its own type name and a numeric code).
    endpoint = serve_endpoint(tenant.org, engine)
    _assert_ends_with_an_error_event(_events(gateway, tenant, endpoint, "vllm_error"), "server_error")


def test_an_engines_error_event_in_the_responses_apis_shape_is_relayed_as_it_was(gateway, tenant, engine):
    endpoint = serve_endpoint(tenant.org, engine)
    events = _events(gateway, tenant, endpoint, "error")
    assert isinstance(events[-1], ResponseErrorEvent) and events[-1].code == "internal_error"
    assert events[-1].sequence_number == 61
