"""The wizard suggests GPUs per replica and shows the count's errors; the staff fleet page shows who holds each GPU."""

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import Role
from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import Node
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory
from tests.test_gpus_per_replica import SPEC

pytestmark = pytest.mark.django_db


def test_the_wizard_suggests_the_smallest_count_for_the_model_and_its_context(owner):
    url = reverse("console:endpoint-gpus")
    page = owner.get(url, SPEC).content.decode()
    assert "Suggested: 2" in page
    longer = owner.get(url, SPEC | {"max_model_len": "131072"}).content.decode()
    assert "Suggested: 8" in longer  # the KV cache of a long context takes more GPUs
    assert "Suggested: 1" in owner.get(url, SPEC | {"model_source": "hf:org/model-1B"}).content.decode()


def test_the_wizard_shows_the_count_error_on_its_field(owner):
    form = {"name": "big-chat", "model_source": SPEC["model_source"], "gpu_type": "h100-80gb", "quantization": "none",
            "gpus_per_replica": "1", "min_replicas": "0", "max_replicas": "1", "idle_timeout_s": "300",
            "target_concurrency": "8", "max_model_len": "4096", "max_num_seqs": "2", "cold_start_timeout_s": "300"}
    response = owner.post(reverse("console:endpoint-new"), form)
    assert response.status_code == 400 and "at least 2 × NVIDIA H100 80 GB per replica" in response.content.decode()
    assert owner.post(reverse("console:endpoint-new"), form | {"gpus_per_replica": ""}).status_code == 302
    assert Endpoint.objects.get(name="big-chat").gpus_per_replica == 2


def test_the_fleet_page_shows_which_replica_holds_which_gpu(org, console_client_factory):
    staff = console_client_factory(org, Role.OWNER, is_staff=True)
    gpus = [{"index": index, "uuid": f"GPU-{index}", "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81_559, "mig_slices": []}
            for index in range(4)]
    node = Node.objects.create(name="h100-rack-1", gpu_type="h100-80gb", num_gpus=4, gpu_memory_mb=81_559, secret_lookup="x1",
                               secret_digest="x", gpus=gpus, last_heartbeat_at=timezone.now())
    Replica.objects.create(endpoint=EndpointFactory(name="tensor-par"), node=node, state=ReplicaState.READY, gpu_indices=[0, 1])
    Replica.objects.create(endpoint=EndpointFactory(name="sharer"), node=node, state=ReplicaState.READY, gpu_indices=[3],
                           gpu_memory_fraction=0.25)
    page = staff.get(reverse("console:fleet")).content.decode()
    rows = {index: page.split(f'data-testid="gpu-h100-rack-1-{index}"')[1].split("</div>")[0] for index in range(4)}
    assert "tensor-par" in rows[0] and "tensor-par" in rows[1] and "tensor-par" not in rows[3]
    assert "free" in rows[2]
    assert "sharer" in rows[3] and "25% of memory" in rows[3]


def test_the_endpoint_pages_say_how_many_gpus_each_replica_takes(owner):
    endpoint = EndpointFactory(organization=owner.organization, name="wide", gpu_type="h100-80gb", gpus_per_replica=4)
    assert "4 × NVIDIA H100 80 GB" in owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "4 × NVIDIA H100 80 GB" in owner.get(reverse("console:endpoints")).content.decode()
