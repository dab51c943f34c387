"""`/v1/embeddings` through the gateway in front of a real vLLM engine serving the tiny embedding model.

The engine is started as the agent starts an embedding replica (the pooling runner, priority
scheduling), forked by the test process's engine node (`tests.engines`), once for the module. The official `openai` client's `embeddings.create` gets vectors
of the model's size (128) as floats and as base64; `dimensions` shortens them where the model
declares Matryoshka sizes and any other size is a 400 naming `dimensions`; each call writes one
usage row of input tokens, billed at the endpoint's input price.
"""

from __future__ import annotations

import base64
import struct
from decimal import Decimal

import openai
import pytest

from billing.models import UsageRecord
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Scope
from controlplane.accounts.services import Actor
from gpu_agent.protocol import ModelTask, ReplicaSpec
from gpu_agent.runtime.tiny_model import EMBEDDING_MATRYOSHKA_DIMENSIONS, HIDDEN_SIZE
from tests.conftest import wait_until
from tests.engines import serve_engine
from tests.gateway.conftest import serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

NAME = "tiny-embed"
ENGINE_KEY = "key-of-the-embedding-engine"
PRICE_INPUT = Decimal("100")  # per million input tokens


@pytest.fixture(scope="module")
def embedding_engine(engine_node, tiny_embedding_model_dir) -> str:
    # NOTE: task AUTO: the agent reads the model's architecture (LlamaModel) and picks the pooling runner.
    spec = ReplicaSpec(replica_id="embedding-engine", endpoint_id="embeddings", served_model_name=NAME,
                       model_source=str(tiny_embedding_model_dir), max_model_len=512, max_num_seqs=8,
                       engine_api_key=ENGINE_KEY, task=ModelTask.AUTO)
    with serve_engine(engine_node, spec, tiny_embedding_model_dir) as replica:
        yield replica.address


@pytest.fixture
def endpoint(tenant, embedding_engine):
    return serve_endpoint(tenant.org, embedding_engine, name=NAME, engine_key=ENGINE_KEY, task="embed",
                          price_input_per_million=PRICE_INPUT, price_cached_input_per_million=Decimal("10"),
                          price_output_per_million=Decimal("300"))


def _rows(count: int) -> list[UsageRecord]:
    return wait_until(lambda: list(UsageRecord.objects.order_by("started_at")) if UsageRecord.objects.count() >= count
                      else None, 30, message=f"{count} usage rows")


def test_the_openai_client_gets_vectors_of_the_models_size_and_one_usage_row_each(gateway, tenant, endpoint):
    client = tenant.client(gateway, timeout=120)

    floats = client.embeddings.create(model=NAME, input=["hello world", "tell me a story"], encoding_format="float")
    assert [len(item.embedding) for item in floats.data] == [HIDDEN_SIZE, HIDDEN_SIZE]
    assert [item.index for item in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens > 0 and floats.usage.total_tokens == floats.usage.prompt_tokens

    # The client's default asks for base64 and decodes it: the same vectors.
    decoded = client.embeddings.create(model=NAME, input=["hello world", "tell me a story"])
    assert [len(item.embedding) for item in decoded.data] == [HIDDEN_SIZE, HIDDEN_SIZE]
    assert decoded.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-5)

    raw = client.embeddings.create(model=NAME, input="hello world", encoding_format="base64")
    packed = base64.b64decode(raw.data[0].embedding)
    assert len(packed) == 4 * HIDDEN_SIZE
    assert list(struct.unpack(f"<{HIDDEN_SIZE}f", packed)) == pytest.approx(floats.data[0].embedding, abs=1e-5)

    tokens = client.embeddings.create(model=NAME, input=[[1, 40, 41], [1, 50]], encoding_format="float")
    assert len(tokens.data) == 2 and tokens.usage.prompt_tokens == 5
    single_tokens = client.embeddings.create(model=NAME, input=[1, 40, 41], encoding_format="float")
    assert len(single_tokens.data) == 1 and single_tokens.usage.prompt_tokens == 3

    rows = _rows(5)
    assert len(rows) == 5 and {row.status for row in rows} == {"ok"}
    assert [row.prompt_tokens for row in rows][-2:] == [5, 3]
    assert rows[0].prompt_tokens == floats.usage.prompt_tokens
    assert all(row.completion_tokens == 0 for row in rows)
    assert rows[-1].cost == Decimal(3) * PRICE_INPUT / Decimal(1_000_000)


def test_dimensions_shorten_the_vectors_to_a_matryoshka_size_and_any_other_is_a_400(gateway, tenant, endpoint):
    client = tenant.client(gateway, timeout=120)
    for size in EMBEDDING_MATRYOSHKA_DIMENSIONS:
        answer = client.embeddings.create(model=NAME, input="hello", dimensions=size, encoding_format="float")
        assert len(answer.data[0].embedding) == size
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=NAME, input="hello", dimensions=33)
    assert refused.value.param == "dimensions" and "33" in refused.value.message
    _rows(len(EMBEDDING_MATRYOSHKA_DIMENSIONS))
    assert UsageRecord.objects.count() == len(EMBEDDING_MATRYOSHKA_DIMENSIONS)  # the refused call cost nothing


def test_the_engine_runs_a_prioritised_call_of_a_key_allowed_to_set_one(gateway, tenant, endpoint):
    key = create_api_key(Actor(user=tenant.owner), tenant.org, name="urgent", scopes=[Scope.INFERENCE],
                         max_priority_boost=10).plain
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=120)
    for priority in (-10, 10):
        answer = client.embeddings.create(model=NAME, input="hello", encoding_format="float",
                                          extra_body={"priority": priority})
        assert len(answer.data[0].embedding) == HIDDEN_SIZE
    assert [row.status for row in _rows(2)] == ["ok", "ok"]
