"""Pre-warm windows and keep-warm in the console: one window per line in the wizard, shown on the endpoint page."""

import pytest
from django.urls import reverse

from endpoints.models import Endpoint
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db

OFFICE_HOURS = {"schedule": "0 9 * * 1-5", "timezone": "Europe/Paris", "duration_minutes": 600, "min_replicas": 2}


def test_the_console_takes_windows_one_per_line_and_shows_them_with_their_next_opening(owner):
    endpoint = EndpointFactory(organization=owner.organization, max_replicas=3)
    form = owner.get(reverse("console:endpoint-edit", args=[endpoint.pk])).content.decode()
    assert "Pre-warm windows" in form and "Keep warm after a cold start" in form
    spec = {
        "name": endpoint.name, "model_source": endpoint.model_source, "gpu_type": endpoint.gpu_type,
        "quantization": endpoint.quantization, "min_replicas": "0", "max_replicas": "3", "idle_timeout_s": "300",
        "target_concurrency": "8", "max_num_seqs": "64", "cold_start_timeout_s": "300", "gpus_per_replica": "",
        "prewarm_windows": "0 9 * * 1-5 Europe/Paris 600 2\n", "keep_warm_after_cold_start_s": "120",
    }
    bad = owner.post(reverse("console:endpoint-edit", args=[endpoint.pk]), spec | {"prewarm_windows": "at nine"})
    assert bad.status_code == 400 and "Window 1: missing" in bad.content.decode()
    saved = owner.post(reverse("console:endpoint-edit", args=[endpoint.pk]), spec)
    assert saved.status_code == 302, [line for line in saved.content.decode().splitlines() if "error" in line]
    endpoint.refresh_from_db()
    assert endpoint.prewarm_windows == [OFFICE_HOURS] and endpoint.keep_warm_after_cold_start_s == 120
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "<code>0 9 * * 1-5</code> Europe/Paris: 2 replicas for 600 min, next opens" in page
    assert "120 s" in page
    edit = owner.get(reverse("console:endpoint-edit", args=[endpoint.pk])).content.decode()
    assert "0 9 * * 1-5 Europe/Paris 600 2" in edit


def test_a_stored_window_whose_date_never_comes_is_shown_as_never_opening(owner):
    """Before, the endpoint's page was a 500 (croniter found no next 30 February)."""
    endpoint = EndpointFactory(organization=owner.organization, max_replicas=3)
    never = OFFICE_HOURS | {"schedule": "0 9 30 2 *"}
    Endpoint.objects.filter(pk=endpoint.pk).update(prewarm_windows=[OFFICE_HOURS, never])  # stored before they were refused
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "<code>0 9 * * 1-5</code> Europe/Paris: 2 replicas for 600 min, next opens" in html
    assert "<code>0 9 30 2 *</code> Europe/Paris: 2 replicas for 600 min (never opens: no such date)" in html
