"""`gpus_per_replica` on the endpoint spec: checked against the GPU catalogue and the model's estimated size
(the wizard and the fleet page: tests/console/test_gpu_pages.py)."""

import pytest

from endpoints.models import Endpoint
from tests.test_quotas import _on_plan

pytestmark = pytest.mark.django_db

SPEC = {"name": "big-chat", "model_source": "hf:meta-llama/Llama-3.3-70B-Instruct", "gpu_type": "h100-80gb",
        "max_model_len": 4096, "max_num_seqs": 2}  # about 157 GB by placement's estimate: two H100s


def create(client, **changes):
    return client.post("/api/v1/endpoints/", SPEC | changes, format="json")


def test_a_count_outside_one_two_four_eight_is_a_field_error(owner_client):
    response = create(owner_client, gpus_per_replica=3)
    assert response.status_code == 400 and "gpus_per_replica" in response.json()


def test_a_count_too_small_for_the_model_names_the_smallest_that_fits(owner_client):
    response = create(owner_client, gpus_per_replica=1)
    assert response.status_code == 400
    (message,) = response.json()["gpus_per_replica"]
    assert "at least 2 × NVIDIA H100 80 GB per replica" in message
    assert create(owner_client, gpus_per_replica=2).status_code == 201


def test_an_omitted_count_is_the_smallest_that_holds_the_model(owner_client):
    response = create(owner_client)
    assert response.status_code == 201 and response.json()["gpus_per_replica"] == 2
    small = create(owner_client, name="small", model_source="hf:org/model-1B")
    assert small.json()["gpus_per_replica"] == 1


def test_a_model_no_count_can_hold_is_refused_with_what_to_change(owner_client):
    response = create(owner_client, model_source="hf:meta-llama/Llama-3.1-405B-Instruct", gpu_type="l4")
    assert response.status_code == 400
    assert "does not fit on 8 × NVIDIA L4 24 GB" in response.json()["gpus_per_replica"][0]


def test_cpu_replicas_run_on_one_engine_and_only_one_gpu_replicas_share(owner_client):
    cpu = create(owner_client, model_source="hf:org/model-1B", gpu_type="cpu", max_model_len=1024, gpus_per_replica=2)
    assert cpu.status_code == 400 and "use 1" in cpu.json()["gpus_per_replica"][0]
    sharing = create(owner_client, gpus_per_replica=2, allow_gpu_sharing=True)
    assert sharing.status_code == 400 and "Only one-GPU replicas" in sharing.json()["allow_gpu_sharing"][0]


def test_an_update_to_a_count_that_no_longer_fits_is_refused(owner_client):
    endpoint_id = create(owner_client).json()["id"]
    response = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"gpus_per_replica": 1}, format="json")
    assert response.status_code == 400 and "at least 2" in response.json()["gpus_per_replica"][0]
    assert Endpoint.objects.get(pk=endpoint_id).gpus_per_replica == 2


def test_a_plans_gpu_quota_bounds_gpus_not_replicas(owner_client, org):
    _on_plan(org, max_replicas=10, max_gpus_by_type={"h100-80gb": 4})
    too_many = create(owner_client, gpus_per_replica=2, max_replicas=3)
    assert too_many.status_code == 400
    assert "at most 2 replicas at once on h100-80gb" in too_many.json()["max_replicas"][0]
    too_wide = create(owner_client, gpus_per_replica=8, max_replicas=1)
    assert too_wide.status_code == 400 and "one replica here takes 8" in too_wide.json()["gpus_per_replica"][0]
    assert create(owner_client, gpus_per_replica=2, max_replicas=2).status_code == 201
