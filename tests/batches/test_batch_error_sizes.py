"""A batch keeps at most `MAX_ERRORS` line errors in `Batch.errors` (jsonb), returned by every GET of the batch and
of the batches list: each error's text is bounded, whatever a line quotes (a `logit_bias` key was echoed whole, twice,
so 100 lines with 100 KB keys stored 20 MB of errors on one batch)."""
from __future__ import annotations

import json

import pytest

from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus
from endpoints.batches.validation import MAX_ERROR_TEXT, LineError
from tests.batches.conftest import new_batch
from tests.factories import EndpointFactory

KEY_CHARS = 100_000
NUM_LINES = 100


def _line(number: int, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "logit_bias": {"9" * KEY_CHARS: 1000}}  # out of range: the key is named in the error
    return json.dumps({"custom_id": f"r{number}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"


@pytest.mark.django_db(transaction=True)
def test_a_batch_s_errors_do_not_echo_long_logit_bias_keys(files_bucket):
    endpoint = EndpointFactory(max_model_len=2048)
    batch = new_batch(endpoint, "".join(_line(n, endpoint.name) for n in range(NUM_LINES)).encode())

    services.run_batch(batch.pk)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == BatchStatus.FAILED
    assert len(batch.errors) == NUM_LINES
    assert len(json.dumps(batch.errors)) < 50_000
    assert batch.errors[0]["param"] == "body.logit_bias." + "9" * 64


def test_a_line_error_s_text_is_cut_whatever_it_quotes():
    entry = LineError(1, "invalid_value", "x" * 10 * MAX_ERROR_TEXT, "\x00" * MAX_ERROR_TEXT).as_openai()

    assert len(entry["message"]) == len(entry["param"]) == MAX_ERROR_TEXT
    assert entry["param"].startswith("\\x00")
