"""Sleep mode in the console: the wizard offers "When idle: sleep" only where the platform allows it."""

import pytest
from django.urls import reverse

from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


def test_the_console_offers_sleep_only_where_the_platform_allows_it(owner, settings):
    endpoint = EndpointFactory(organization=owner.organization, max_replicas=1)
    settings.SLEEP_MODE = False
    assert "When idle" not in owner.get(reverse("console:endpoint-edit", args=[endpoint.pk])).content.decode()
    settings.SLEEP_MODE = True
    assert "When idle" in owner.get(reverse("console:endpoint-edit", args=[endpoint.pk])).content.decode()
    spec = {
        "name": endpoint.name, "model_source": endpoint.model_source, "gpu_type": endpoint.gpu_type,
        "quantization": endpoint.quantization, "min_replicas": "0", "max_replicas": "1", "idle_timeout_s": "300",
        "target_concurrency": "8", "max_num_seqs": "64", "cold_start_timeout_s": "300", "gpus_per_replica": "",
        "idle_action": "sleep",
    }
    saved = owner.post(reverse("console:endpoint-edit", args=[endpoint.pk]), spec)
    assert saved.status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.idle_action == "sleep"
    assert "300 s, then sleep" in owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
