"""Dashboard, deploy wizard and endpoint page, through Django's test client."""

import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from billing.models import UsageRecord
from controlplane.accounts.models import Role
from endpoints.models import Endpoint, EndpointEvent, EventKind, Replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

VALID_SPEC = {
    "name": "support-chat", "model_source": "hf:meta-llama/Llama-3.1-8B-Instruct", "gpu_type": "l4",
    "quantization": "fp8", "min_replicas": "0", "max_replicas": "2", "idle_timeout_s": "300",
    "target_concurrency": "8", "max_model_len": "4096", "max_num_seqs": "64", "max_num_batched_tokens": "",
    "cold_start_timeout_s": "300", "enable_prefix_caching": "on",
}


def usage_row(endpoint, *, started_at, prompt=10, completion=20, latency_ms=200, cost="0.000010"):
    return UsageRecord.objects.create(
        request_id=f"req-{UsageRecord.objects.count()}-{started_at.timestamp()}", organization=endpoint.organization,
        endpoint=endpoint, prompt_tokens=prompt, completion_tokens=completion, cost=Decimal(cost),
        started_at=started_at, first_token_at=started_at + timedelta(milliseconds=50),
        finished_at=started_at + timedelta(milliseconds=latency_ms), status="ok",
    )


def test_dashboard_shows_endpoints_and_todays_usage(owner):
    endpoint = EndpointFactory(organization=owner.organization, name="chat-a")
    usage_row(endpoint, started_at=timezone.now() - timedelta(minutes=1), prompt=100, completion=23, cost="1.25")
    page = owner.get(reverse("console:dashboard")).content.decode()
    assert "chat-a" in page
    assert 'data-testid="requests-today">1<' in page
    assert 'data-testid="tokens-today">123<' in page
    assert "$1.25" in page
    assert 'hx-trigger="every 3s"' in page


def test_dashboard_of_a_new_organisation_invites_a_first_deploy(owner):
    page = owner.get(reverse("console:dashboard")).content.decode()
    assert "Deploy your first model" in page
    assert reverse("console:endpoint-new") in page


def test_live_endpoint_table_is_a_partial(owner):
    EndpointFactory(organization=owner.organization, name="chat-b")
    page = owner.get(reverse("console:endpoints-live")).content.decode()
    assert "chat-b" in page and "<html" not in page


def test_wizard_shows_gpu_memory_and_hourly_cost(owner):
    page = owner.get(reverse("console:endpoint-new")).content.decode()
    assert "141 GB" in page and "$5.00/h" in page
    assert "NVIDIA L4 24 GB" in page


def test_wizard_counts_no_node_whose_host_the_gateway_refuses(owner, settings):
    settings.ALLOW_LOOPBACK_NODES = False  # registered on loopback before the deployment refused it
    make_node(gpu_type="h100-80gb", memory_mb=80_000, advertise_host="127.0.0.1", id=uuid.UUID(int=1))  # first by id
    make_node(gpu_type="l4", advertise_host="10.0.3.7")
    page = owner.get(reverse("console:endpoint-new")).content.decode()
    h100 = page[page.index('id="gpu-h100-80gb"'):]
    assert h100[:h100.index("</label>")].count("no nodes ready now") == 1
    assert 'id="gpu-l4" value="l4" checked' in page  # placement would use the l4 node, not the h100 one


def test_wizard_offers_only_quantizations_of_the_gpu_type(owner):
    page = owner.get(reverse("console:endpoint-quantizations"), {"gpu_type": "cpu"}).content.decode()
    assert 'value="fp8_per_channel"' in page
    assert 'value="awq"' not in page and 'value="fp8"' not in page and 'value="int8"' not in page


def test_wizard_creates_the_endpoint_and_redirects_to_its_page(owner):
    response = owner.post(reverse("console:endpoint-new"), VALID_SPEC)
    endpoint = Endpoint.objects.get(organization=owner.organization, name="support-chat")
    assert response.status_code == 302 and response.url == reverse("console:endpoint", args=[endpoint.pk])
    assert endpoint.quantization == "fp8" and endpoint.max_replicas == 2 and endpoint.max_num_batched_tokens is None
    assert endpoint.enable_prefix_caching is True
    assert endpoint.events.filter(kind=EventKind.CONFIG).exists()


def test_wizard_never_says_an_endpoint_starts_now_for_minimum_replicas_its_organisation_without_a_card_does_not_keep(
        owner, settings):
    """An organisation held to the idle cap keeps no warm floor (`autoscaler.floor`): the wizard said its endpoint
    started "now, for its minimum replicas", and none ever started."""
    settings.STRIPE_SECRET_KEY = "sk_test_inferplane"
    settings.IDLE_TIMEOUT_WITHOUT_CARD_S = 300

    page = owner.post(reverse("console:endpoint-new"), VALID_SPEC | {"min_replicas": "1"}, follow=True).content.decode()

    assert "is deployed" in page and "now, for its minimum replicas" not in page
    assert "its minimum replicas stay warm once the organisation has a payment method" in page


def test_wizard_shows_the_serializers_errors_next_to_their_fields(owner):
    spec = VALID_SPEC | {"name": "Bad Name!", "model_source": "ftp://x", "gpu_type": "cpu", "quantization": "awq",
                         "min_replicas": "3", "max_replicas": "1", "max_model_len": "abc"}
    response = owner.post(reverse("console:endpoint-new"), spec)
    page = response.content.decode()
    assert response.status_code == 400
    assert not Endpoint.objects.filter(organization=owner.organization).exists()
    assert "Use 1-63 lowercase letters" in page
    assert "Must start with hf:, s3:// or /" in page
    assert "A valid integer is required." in page
    assert page.count("has-error") >= 3
    assert 'value="Bad Name!"' in page  # what the user typed stays in the form


def test_a_model_source_with_a_nul_is_a_field_error_in_the_wizard_and_no_suggestion_not_a_500(owner):
    """The wizard's GPU suggestion looked the typed source up in the models' reported sizes before the serializer
    had refused it, and PostgreSQL refuses NUL: the new and edit forms (and the suggestion htmx asks for as the
    source is typed) were a 500 where the API answers a 400 naming `model_source`."""
    owner.raise_request_exception = False
    endpoint = EndpointFactory(organization=owner.organization)
    spec = VALID_SPEC | {"model_source": "hf:Qwen/Qwen2.5-0.5B\x00"}

    for url in (reverse("console:endpoint-new"), reverse("console:endpoint-edit", args=[endpoint.pk])):
        response = owner.post(url, spec)
        assert response.status_code == 400, url
        assert "Null characters are not allowed." in response.content.decode()
    suggestion = owner.get(reverse("console:endpoint-gpus"), {"model_source": spec["model_source"], "gpu_type": "l4"})
    assert suggestion.status_code == 200


def test_wizard_reports_quantization_and_replica_rules(owner):
    spec = VALID_SPEC | {"gpu_type": "cpu", "quantization": "awq", "min_replicas": "3", "max_replicas": "1"}
    page = owner.post(reverse("console:endpoint-new"), spec).content.decode()
    assert "is not available on cpu" in page
    assert "Must be at least max(1, min_replicas) = 3." in page


def test_wizard_shows_the_quota_a_spec_would_pass_next_to_its_field(owner, settings):
    settings.DEFAULT_MAX_MIN_REPLICAS = 1
    spec = VALID_SPEC | {"min_replicas": "2", "max_replicas": "2"}
    response = owner.post(reverse("console:endpoint-new"), spec)
    assert response.status_code == 400
    assert "Your plan keeps at most 1 replicas warm over all endpoints (quota max_min_replicas)" in response.content.decode()


def test_wizard_refuses_a_duplicate_name(owner):
    EndpointFactory(organization=owner.organization, name="support-chat")
    page = owner.post(reverse("console:endpoint-new"), VALID_SPEC).content.decode()
    assert "already exists in your organisation" in page


def test_viewer_cannot_deploy(viewer):
    assert viewer.post(reverse("console:endpoint-new"), VALID_SPEC).status_code == 403
    assert not Endpoint.objects.exists()
    assert "New endpoint" not in viewer.get(reverse("console:endpoints")).content.decode()


def test_endpoint_page_shows_state_replicas_events_snippets_and_playground(owner, settings):
    settings.PUBLIC_URL = "https://api.inferplane.test"
    endpoint = EndpointFactory(organization=owner.organization, name="chat-c")
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.STARTING, progress="downloading weights", progress_percent=42)
    EndpointEvent.objects.create(endpoint=endpoint, kind=EventKind.COLD_START, message="Replica abc READY after 12.5 s")
    EndpointEvent.objects.create(endpoint=endpoint, kind=EventKind.FAILURE, message="Replica def failed: OOM",
                                 details={"reason": "CUDA out of memory"})
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "Starting" in page and "downloading weights" in page and 'aria-valuenow="42"' in page
    assert "READY after 12.5 s" in page and "CUDA out of memory" in page
    assert 'base_url="https://api.inferplane.test/v1"' in page and 'model="chat-c"' in page
    assert "curl https://api.inferplane.test/v1/chat/completions" in page
    assert 'data-model="chat-c"' in page and 'data-price-output="0.300000"' in page


def test_an_embedding_endpoints_page_offers_an_embeddings_playground_and_snippets(owner, settings):
    settings.PUBLIC_URL = "https://api.inferplane.test"
    endpoint = EndpointFactory(organization=owner.organization, name="docs-embed", task="embed")
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert 'data-url="/v1/embeddings"' in page and 'data-task="embed"' in page
    assert "curl https://api.inferplane.test/v1/embeddings" in page and "client.embeddings.create(" in page
    assert "/v1/chat/completions" not in page and "chat.completions" not in page


def test_the_wizard_deploys_an_embedding_endpoint(owner):
    response = owner.post(reverse("console:endpoint-new"), VALID_SPEC | {"name": "docs-embed", "task": "embed"})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Endpoint.objects.get(name="docs-embed").task == "embed"


def test_endpoint_live_partial_updates_state_out_of_band(owner):
    endpoint = EndpointFactory(organization=owner.organization)
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.READY)
    page = owner.get(reverse("console:endpoint-live", args=[endpoint.pk])).content.decode()
    assert 'hx-swap-oob="true"' in page and "Ready" in page and "<html" not in page


def test_metrics_are_per_minute_buckets_from_the_ledger(owner):
    endpoint = EndpointFactory(organization=owner.organization)
    now = timezone.now()
    for latency_ms in (100, 200, 300, 400):
        usage_row(endpoint, started_at=now - timedelta(minutes=2), latency_ms=latency_ms, completion=60)
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.READY, created_at=now - timedelta(minutes=30))
    body = owner.get(reverse("console:endpoint-metrics", args=[endpoint.pk])).json()
    series = body["series"]
    assert body["bucket_s"] == 60 and len(series["t"]) == 60
    assert sum(series["requests"]) == 4
    busy = series["requests"].index(4)
    assert series["p50_ms"][busy] == pytest.approx(250, abs=1)
    assert series["p95_ms"][busy] == pytest.approx(385, abs=1)
    assert series["tokens_per_s"][busy] == pytest.approx(4.0)
    assert series["replicas"][-1] == 1 and series["replicas"][0] == 0
    assert all(value is None for i, value in enumerate(series["p50_ms"]) if i != busy)


def test_metrics_windows_use_coarser_buckets(owner):
    endpoint = EndpointFactory(organization=owner.organization)
    body = owner.get(reverse("console:endpoint-metrics", args=[endpoint.pk]), {"minutes": "1440"}).json()
    assert body["bucket_s"] == 900 and len(body["series"]["t"]) == 96


def test_edit_goes_through_the_same_validation(owner):
    endpoint = EndpointFactory(organization=owner.organization, name="chat-d", gpus_per_replica=2)  # an 8B model on L4s
    url = reverse("console:endpoint-edit", args=[endpoint.pk])
    assert 'value="chat-d"' in owner.get(url).content.decode()
    response = owner.post(url, VALID_SPEC | {"name": "chat-d", "min_replicas": "3", "max_replicas": "2"})
    assert response.status_code == 400 and "Must be at least max(1, min_replicas)" in response.content.decode()
    response = owner.post(url, VALID_SPEC | {"name": "chat-d", "max_replicas": "4"})  # 8 GPUs: the default quota
    assert response.status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.max_replicas == 4


def test_pause_resume_and_delete_with_confirmation(owner):
    endpoint = EndpointFactory(organization=owner.organization, name="chat-e")
    owner.post(reverse("console:endpoint-pause", args=[endpoint.pk]))
    endpoint.refresh_from_db()
    assert endpoint.paused_at is not None
    assert "Resume" in owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    owner.post(reverse("console:endpoint-resume", args=[endpoint.pk]))
    endpoint.refresh_from_db()
    assert endpoint.paused_at is None
    delete_url = reverse("console:endpoint-delete", args=[endpoint.pk])
    assert owner.post(delete_url, {"confirm_name": "wrong"}).status_code == 400
    assert owner.post(delete_url, {"confirm_name": "chat-e"}).status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.deleted_at is not None
    assert owner.get(reverse("console:endpoint", args=[endpoint.pk])).status_code == 404


def test_viewer_cannot_pause_edit_or_delete(viewer):
    endpoint = EndpointFactory(organization=viewer.organization)
    assert viewer.post(reverse("console:endpoint-pause", args=[endpoint.pk])).status_code == 403
    assert viewer.post(reverse("console:endpoint-edit", args=[endpoint.pk]), VALID_SPEC).status_code == 403
    assert viewer.post(reverse("console:endpoint-delete", args=[endpoint.pk]), {"confirm_name": endpoint.name}).status_code == 403
    endpoint.refresh_from_db()
    assert endpoint.paused_at is None and endpoint.deleted_at is None
    assert viewer.get(reverse("console:endpoint", args=[endpoint.pk])).status_code == 200


@pytest.mark.parametrize("name", ["endpoint", "endpoint-live", "endpoint-metrics", "endpoint-edit", "endpoint-delete"])
def test_another_organisations_endpoint_is_a_404(owner, other_endpoint, name):
    assert owner.get(reverse(f"console:{name}", args=[other_endpoint.pk])).status_code == 404


@pytest.mark.parametrize("name", ["endpoint-pause", "endpoint-resume", "endpoint-delete"])
def test_writes_to_another_organisations_endpoint_are_404s(owner, other_endpoint, name):
    assert owner.post(reverse(f"console:{name}", args=[other_endpoint.pk]), {"confirm_name": "theirs"}).status_code == 404
    other_endpoint.refresh_from_db()
    assert other_endpoint.paused_at is None and other_endpoint.deleted_at is None


def test_console_needs_a_login(client):
    response = client.get(reverse("console:dashboard"))
    assert response.status_code == 302 and response.url.startswith(reverse("login"))


@pytest.mark.parametrize("role, shows_node", [(Role.OWNER, True), (Role.ADMIN, True), (Role.MEMBER, False),
                                              (Role.VIEWER, False)])
def test_the_replica_table_names_its_nodes_to_owners_and_admins_only(org, console_client_factory, role, shows_node):
    """As the API: before, every role was shown which node runs each replica."""
    endpoint = EndpointFactory(organization=org)
    node = make_node()
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    client = console_client_factory(org, role)
    for url in (reverse("console:endpoint", args=[endpoint.pk]), reverse("console:endpoint-live", args=[endpoint.pk])):
        page = client.get(url).content.decode()
        assert (node.name in page) is shows_node, url


def test_prices_are_shown_as_charged_never_rounded_to_the_cent(owner):
    # Before: `usd` rounded every price to the cent, so the demo's cached-input price of $0.025 / M read "$0.02 / M"
    # (and $0.125 "$0.12"): the customer was shown less than the ledger charges them.
    endpoint = EndpointFactory(organization=owner.organization, name="priced", price_input_per_million=Decimal("0.125"),
                               price_cached_input_per_million=Decimal("0.025"), price_output_per_million=Decimal("1.5"))
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "$0.125 / M" in page and "$0.025 / M" in page and "$1.50 / M" in page
    assert "$0.12 / M" not in page and "$0.02 / M" not in page
    listing = owner.get(reverse("console:endpoints")).content.decode()
    assert "$0.125 · $1.50" in listing
