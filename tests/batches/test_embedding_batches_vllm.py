"""An `/v1/embeddings` batch with the official `openai` client on a real vLLM CPU engine serving the tiny embedding
model (started as the agent starts an embedding replica: the pooling runner, priority scheduling): every input shape a
line may send comes back as the model's vectors in OpenAI's batch output, a `dimensions` the model does not offer fails
its line alone (the engine's 400, naming it), and each line that ran is one usage row of its prompt tokens at the
endpoint's batch price. Before, `batches.create(endpoint="/v1/embeddings")` was a 400."""

from __future__ import annotations

import base64
import io
import json
from decimal import Decimal

import pytest

from billing.ledger import cost_of
from billing.models import UsageRecord
from gpu_agent.protocol import ModelTask, ReplicaSpec
from gpu_agent.runtime.tiny_model import EMBEDDING_MATRYOSHKA_DIMENSIONS, HIDDEN_SIZE
from tests.batches.conftest import ended_batch
from tests.engines import serve_engine
from tests.gateway.conftest import serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

NAME = "tiny-embed"
ENGINE_KEY = "key-of-the-embedding-engine"
PRICE_INPUT = Decimal("100")  # per million input tokens


@pytest.fixture(scope="module")
def embedding_engine(engine_node, tiny_embedding_model_dir) -> str:
    spec = ReplicaSpec(
        replica_id="batch-embedding-engine",
        endpoint_id="batch-embeddings",
        served_model_name=NAME,
        model_source=str(tiny_embedding_model_dir),
        max_model_len=512,
        max_num_seqs=8,
        engine_api_key=ENGINE_KEY,
        task=ModelTask.AUTO,
    )
    with serve_engine(engine_node, spec, tiny_embedding_model_dir) as replica:
        yield replica.address


def _line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": NAME} | body}


def test_an_embeddings_batch_answers_every_input_shape_with_the_models_vectors_billed_once_a_line(
    embedding_engine, gateway, tenant, batch_worker
):
    endpoint = serve_endpoint(
        tenant.org,
        embedding_engine,
        name=NAME,
        engine_key=ENGINE_KEY,
        task="embed",
        price_input_per_million=PRICE_INPUT,
        target_concurrency=4,
    )
    client = tenant.client(gateway, timeout=120)
    size = EMBEDDING_MATRYOSHKA_DIMENSIONS[0]
    rows = [
        _line("text", input="hello world", encoding_format="float"),
        _line("texts", input=["hello world", "tell me a story"], encoding_format="float"),
        _line("token-ids", input=[1, 40, 41], encoding_format="float"),
        _line("token-id-lists", input=[[1, 40, 41], [1, 50]], encoding_format="float"),
        _line("base64", input="hello world", encoding_format="base64"),
        _line("shorter", input="hello world", dimensions=size, encoding_format="float"),
        _line("unoffered-size", input="hello world", dimensions=33),
    ]
    data = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    input_file = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=input_file.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.endpoint == "/v1/embeddings"

    batch = ended_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        7,
        6,
        1,
    )

    output = {
        row["custom_id"]: row
        for row in map(json.loads, client.files.content(batch.output_file_id).read().splitlines())
    }
    bodies = {custom_id: row["response"]["body"] for custom_id, row in output.items()}
    assert all(row["response"]["status_code"] == 200 and row["error"] is None for row in output.values())
    assert [len(item["embedding"]) for item in bodies["texts"]["data"]] == [HIDDEN_SIZE, HIDDEN_SIZE]
    assert len(bodies["text"]["data"]) == 1 and bodies["text"]["object"] == "list"
    assert (len(bodies["token-ids"]["data"]), bodies["token-ids"]["usage"]["prompt_tokens"]) == (1, 3)
    assert (len(bodies["token-id-lists"]["data"]), bodies["token-id-lists"]["usage"]["prompt_tokens"]) == (
        2,
        5,
    )
    assert len(base64.b64decode(bodies["base64"]["data"][0]["embedding"])) == 4 * HIDDEN_SIZE
    assert (
        bodies["base64"]["data"][0]["embedding"] != bodies["text"]["data"][0]["embedding"]
    )  # encoded, not floats
    assert len(bodies["shorter"]["data"][0]["embedding"]) == size

    [refused] = map(json.loads, client.files.content(batch.error_file_id).read().splitlines())
    assert refused["custom_id"] == "unoffered-size" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "dimensions"

    # One usage row a line that ran (the refused one cost nothing): its prompt tokens, at the batch price.
    records = {record.request_id: record for record in UsageRecord.objects.filter(batch_id=batch.id)}
    assert set(records) == {row["response"]["request_id"] for row in output.values()}
    for custom_id, body in bodies.items():
        record = records[output[custom_id]["response"]["request_id"]]
        assert (record.prompt_tokens, record.completion_tokens) == (body["usage"]["prompt_tokens"], 0)
        assert (
            record.cost
            == cost_of(endpoint, record.prompt_tokens, record.cached_tokens, 0, fraction=Decimal("0.5"))
            > 0
        )
    assert not UsageRecord.objects.exclude(batch_id=batch.id).exists()
