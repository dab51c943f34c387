"""infra/k8s: every overlay renders, validates against the Kubernetes schemas, and runs the platform as designed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.infra.conftest import run_tool, tool

# Validated against the oldest Kubernetes the manifests support (the preStop `sleep` action is on by
# default from 1.30) and the newest whose schemas kubernetes-validate bundles. Both are offline: the
# package ships the schemas with their references resolved (`<version>-local-strict`).
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")

DJANGO_PROCESSES = [
    ("Deployment", "inferplane-web"),
    ("Deployment", "inferplane-worker"),
    ("Deployment", "inferplane-batch-worker"),
    ("Deployment", "inferplane-beat"),
    ("Job", "inferplane-migrate"),
]
SECRET_SETTINGS = {
    "DJANGO_SECRET_KEY",
    "INFERPLANE_ENCRYPTION_KEYS",
    "DATABASE_URL",
    "REDIS_URL",
    "STRIPE_SECRET_KEY",
    "STRIPE_WEBHOOK_SECRET",
    "EMAIL_HOST_PASSWORD",
    "INFERPLANE_METRICS_TOKEN",
}


def _validate(path, version: str) -> subprocess.CompletedProcess:
    return run_tool(
        [tool("kubernetes-validate"), "--strict", "--quiet", "--kubernetes-version", version, str(path)]
    )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_overlay_validates_strictly_against_the_kubernetes_schemas(rendered, version, tmp_path):
    manifest = tmp_path / f"{rendered.overlay}.yaml"
    manifest.write_text(rendered.text)
    result = _validate(manifest, version)
    assert result.returncode == 0, (
        f"{rendered.overlay} on Kubernetes {version}:\n{result.stdout}{result.stderr}"
    )


def test_the_validator_rejects_an_unknown_field(tmp_path):
    # Proves the strict, offline validation above is really checking something.
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: 80}], replicas: 2}\n"
    )
    result = _validate(manifest, KUBERNETES_VERSIONS[-1])
    assert result.returncode != 0
    assert "replicas" in result.stdout + result.stderr


def _pod_spec(resource: dict) -> dict:
    return resource["spec"]["template"]["spec"]


def _environment(rendered, resource: dict) -> tuple[dict[str, str], set[str]]:
    """The first container's environment: plain values (ConfigMaps resolved), and the names taken from Secrets."""
    container = _pod_spec(resource)["containers"][0]
    values, from_secrets = {}, set()
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, "Secrets are referenced key by key, so the manifests name each one"
        values.update(rendered.get("ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for variable in container.get("env", []):
        if "secretKeyRef" in variable.get("valueFrom", {}):
            from_secrets.add(variable["name"])
        else:
            values[variable["name"]] = variable.get("value", "")
    return values, from_secrets


def test_every_setting_reaches_every_django_process(rendered, settings):
    from controlplane.env import SETTINGS_ENV_VARS

    assert SETTINGS_ENV_VARS, "settings read no environment variables?"
    for kind, name in DJANGO_PROCESSES:
        values, from_secrets = _environment(rendered, rendered.get(kind, name))
        missing = sorted(SETTINGS_ENV_VARS - values.keys() - from_secrets)
        assert not missing, f"{rendered.overlay} {name} does not set {missing}"
        assert from_secrets == SECRET_SETTINGS, f"{rendered.overlay} {name}: secrets {sorted(from_secrets)}"
        assert not SECRET_SETTINGS & values.keys(), f"{rendered.overlay} {name}: a secret sits in a ConfigMap"
        assert values["DJANGO_DEBUG"] == "0"
        assert values["INFERPLANE_ALLOW_LOCAL_MODEL_PATHS"] == "0"
        assert values["INFERPLANE_ALLOW_LOOPBACK_NODES"] == "0"


def test_every_variable_in_the_readme_configuration_table_is_set(rendered):
    table = (REPO_ROOT / "README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    first_cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", " ".join(first_cells)))
    assert len(documented) > 20
    values, from_secrets = _environment(rendered, rendered.get("Deployment", "inferplane-web"))
    assert sorted(documented - values.keys() - from_secrets) == []


def test_production_values_pass_check_deploy(rendered):
    """`manage.py check --deploy` is clean with exactly what the pods get, plus placeholder secrets."""
    values, _ = _environment(rendered, rendered.get("Deployment", "inferplane-web"))
    secrets = {
        "DJANGO_SECRET_KEY": "placeholder-" + "s3cr3t-K3y!" * 6,
        "INFERPLANE_ENCRYPTION_KEYS": "cGxhY2Vob2xkZXItcGxhY2Vob2xkZXItcGxhY2Vob2w=",
        "DATABASE_URL": "postgresql://inferplane:pw@postgres.internal:5432/inferplane",
        "REDIS_URL": "redis://redis.internal:6379/0",
        "STRIPE_SECRET_KEY": "sk_test_placeholder",
        "STRIPE_WEBHOOK_SECRET": "whsec_placeholder",
        "EMAIL_HOST_PASSWORD": "placeholder",
        "INFERPLANE_METRICS_TOKEN": "placeholder-" + "m3tr1cs" * 6,
    }
    # A clean environment: nothing of the test run's own settings leaks into the check.
    clean = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "TMPDIR") if name in os.environ}
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO_ROOT,
        env=clean | values | secrets | {"DJANGO_SETTINGS_MODULE": "controlplane.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{rendered.overlay}:\n{result.stdout}{result.stderr}"
    assert "no issues" in result.stdout


def test_web_probes_use_healthz_and_readyz(rendered):
    web = _pod_spec(rendered.get("Deployment", "inferplane-web"))["containers"][0]
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert web[probe]["httpGet"]["port"] == "http"
    assert "--port=8000" in web["command"] and web["command"][:3] == ["python", "-m", "controlplane.serve"]


def test_web_runs_one_gateway_process_per_cpu_of_its_limit_with_merged_metrics(rendered):
    # controlplane.serve counts the CPUs of the container's limit, and keeps the workers' metrics
    # files under the temporary directory: it must be a writable volume under a read-only root.
    web = _pod_spec(rendered.get("Deployment", "inferplane-web"))["containers"][0]
    assert web["command"][:3] == ["python", "-m", "controlplane.serve"]
    assert float(web["resources"]["limits"]["cpu"]) >= 1
    assert "/tmp" in {mount["mountPath"] for mount in web["volumeMounts"]}
    assert web["securityContext"]["readOnlyRootFilesystem"] is True


MiB = 1024 * 1024
# What the web pod's /tmp holds besides uploads and the usage journal: the workers' metrics files, scratch.
WEB_SCRATCH_BYTES = 128 * MiB
QUANTITY_UNITS = {"Ki": 1024, "Mi": MiB, "Gi": 1024 * MiB, "K": 1000, "M": 1000**2, "G": 1000**3}


def _bytes_of(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMG]i?)?", quantity).groups()
    return int(number) * QUANTITY_UNITS.get(unit, 1)


def _gateway_processes(web: dict, values: dict[str, str]) -> int:
    """How many gateway processes a web pod runs: `--workers`, else WEB_CONCURRENCY, else one per CPU of its limit
    (controlplane.serve)."""
    import math

    from controlplane import serve

    workers = [arg.removeprefix("--workers=") for arg in web["command"] if arg.startswith("--workers=")]
    if workers:
        return int(workers[0])
    if values.get("WEB_CONCURRENCY"):
        return serve.num_workers({"WEB_CONCURRENCY": values["WEB_CONCURRENCY"]})
    cpu = web["resources"]["limits"]["cpu"]
    return math.ceil(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))


def _tmp_size_limit(deployment: dict) -> int:
    container = _pod_spec(deployment)["containers"][0]
    mounted = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volume = {volume["name"]: volume for volume in _pod_spec(deployment)["volumes"]}[mounted["/tmp"]]
    return _bytes_of(volume["emptyDir"]["sizeLimit"])


def test_the_web_pods_tmp_volume_holds_every_upload_its_processes_may_read_at_once_and_a_full_usage_journal(
        rendered, settings):
    """Past its size limit the pod is evicted, every tenant's calls on it cut. An upload holds one copy of its body
    there, cut at INFERPLANE_FILES_MAX_BYTES plus the multipart overhead (Django spools it; the file part goes on to S3), and each gateway process
    reads at most INFERPLANE_FILES_UPLOADS_PER_PROCESS at once. Before, two copies of one upload of 130 MiB passed the
    volume's 256 MiB.

    The usage journal is there too: the gateway admits no new call past INFERPLANE_USAGE_JOURNAL_MAX_BYTES (the
    folder's, every process's together), and the calls admitted before still journal into the headroom above it.
    Before, the journal had no bound: a database refusing writes for half an hour filled the volume, and the pod's
    eviction deleted every usage row of the outage."""
    from billing.usage_journal import ADMITTED_HEADROOM_BYTES
    from endpoints.gateway.upload_places import MULTIPART_OVERHEAD_BYTES

    deployment = rendered.get("Deployment", "inferplane-web")
    web = _pod_spec(deployment)["containers"][0]
    values, _ = _environment(rendered, deployment)
    assert values.get("TMPDIR", "/tmp") == "/tmp" and "FILE_UPLOAD_TEMP_DIR" not in values
    assert values["INFERPLANE_USAGE_JOURNAL_DIR"].startswith("/tmp/")
    size_limit = _tmp_size_limit(deployment)

    uploads_bytes = (_gateway_processes(web, values) * int(values["INFERPLANE_FILES_UPLOADS_PER_PROCESS"])
                     * (int(values["INFERPLANE_FILES_MAX_BYTES"]) + MULTIPART_OVERHEAD_BYTES))
    for source, journal_max_bytes in (("config.env", int(values["INFERPLANE_USAGE_JOURNAL_MAX_BYTES"])),
                                      ("the default", settings.USAGE_JOURNAL_MAX_BYTES)):
        journal_bytes = journal_max_bytes + ADMITTED_HEADROOM_BYTES
        assert uploads_bytes + journal_bytes + WEB_SCRATCH_BYTES <= size_limit, (
            f"{rendered.overlay}: uploads may hold {uploads_bytes / MiB:.0f} MiB of the web pod's /tmp and the usage "
            f"journal {journal_bytes / MiB:.0f} MiB ({source}'s limit and the headroom above it), with "
            f"{WEB_SCRATCH_BYTES / MiB:.0f} MiB of scratch, past its {size_limit / MiB:.0f} MiB")
    assert _bytes_of(web["resources"]["requests"]["ephemeral-storage"]) >= size_limit


# What a gateway process holds besides whole answers: ~120 MiB resident at rest in the tests (Django, the gateway's
# caches), with room for streams' buffers (256 KiB each at most) and what the allocator keeps.
GATEWAY_PROCESS_BYTES = 160 * MiB


def test_the_web_pods_memory_holds_the_answers_its_processes_may_hold_at_once(rendered, settings):
    """Past its memory limit the web container is killed, every tenant's calls on it cut. Each gateway process holds
    at most about twice INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS of whole answers, and one answer more with its copy
    joined as it is read whole (endpoints.gateway.delivery). Bounded per organisation only, forty organisations held
    5 GiB in a pod of 1 GiB."""
    from endpoints.gateway import upstream

    deployment = rendered.get("Deployment", "inferplane-web")
    web = _pod_spec(deployment)["containers"][0]
    values, _ = _environment(rendered, deployment)
    processes = _gateway_processes(web, values)
    limit = _bytes_of(web["resources"]["limits"]["memory"])
    for source, bound in (("config.env", int(values["INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS"])),
                          ("the default", settings.GATEWAY_ANSWER_BYTES_PER_PROCESS)):
        per_process = 2 * bound + 2 * upstream.MAX_WHOLE_BODY_BYTES + GATEWAY_PROCESS_BYTES
        assert processes * per_process <= limit, (
            f"{rendered.overlay}: {processes} gateway processes may hold {per_process / MiB:.0f} MiB each with "
            f"{source}'s {bound / MiB:.0f} MiB of answers, past the web container's {limit / MiB:.0f} MiB")


# What a batch worker process holds besides its lines' answers: ~130 MiB resident at rest with its tasks, boto3's S3
# client and the gateway's call path imported (measured), with room for what boto3 holds beside each row it stores (up
# to 2 MiB a put, measured: ~11 MiB when the bound's 32 MiB are rows being stored) and what the allocator keeps (the
# first read of each line in flight is in the bound: `answer_bytes.READ_BYTES`). Celery's parent process, which runs no task, counts as
# much again, though its children share much of its memory (forked from it).
BATCH_WORKER_PROCESS_BYTES = 160 * MiB


def test_the_batch_workers_memory_holds_the_answers_its_processes_may_hold_at_once(rendered, settings):
    """Past its memory limit the batch worker is killed, every run in it cut. Each of its `--concurrency` processes
    holds its lines' answers within INFERPLANE_BATCH_ANSWER_BYTES, the largest answer included, and one copy of one
    answer beside them as it is read whole, checked or written (endpoints.batches.answer_bytes). Before, one answer of
    up to 64 MiB was read past the bound, with its copy: four processes at their worst held 4 x (32 + 64 + 64) MiB of
    answers beside their own memory, past the container's 1 GiB."""
    from endpoints.batches import answer_bytes

    deployment = rendered.get("Deployment", "inferplane-batch-worker")
    worker = _pod_spec(deployment)["containers"][0]
    values, _ = _environment(rendered, deployment)
    assert "--pool" not in " ".join(worker["command"]), "a prefork pool: each process runs one run at a time"
    concurrency = [arg.removeprefix("--concurrency=") for arg in worker["command"] if arg.startswith("--concurrency=")]
    assert concurrency, "without --concurrency Celery starts a process per CPU of the node, not of the limit"
    processes = int(concurrency[0])
    limit = _bytes_of(worker["resources"]["limits"]["memory"])
    for source, bound in (("config.env", int(values["INFERPLANE_BATCH_ANSWER_BYTES"])),
                          ("the default", settings.BATCH_ANSWER_BYTES)):
        per_process = bound + answer_bytes.largest_answer_bytes(bound) + BATCH_WORKER_PROCESS_BYTES
        assert processes * per_process + BATCH_WORKER_PROCESS_BYTES <= limit, (
            f"{rendered.overlay}: {processes} batch worker processes may hold {per_process / MiB:.0f} MiB each with "
            f"{source}'s {bound / MiB:.0f} MiB of answers, and Celery's parent process its own, past the batch "
            f"worker's {limit / MiB:.0f} MiB")


# What else a batch worker's /tmp holds: Python's and the libraries' scratch files.
BATCH_WORKER_SCRATCH_BYTES = 128 * MiB


def test_the_batch_workers_tmp_volume_holds_the_answers_its_processes_may_spool_at_once(rendered, settings):
    """Past its size limit the pod is evicted, every run in it cut. Each of the batch worker's processes keeps the line
    answers larger than it holds in memory in unnamed files in /tmp, INFERPLANE_BATCH_SPOOL_BYTES of them at most
    (endpoints.batches.spool)."""
    deployment = rendered.get("Deployment", "inferplane-batch-worker")
    worker = _pod_spec(deployment)["containers"][0]
    values, _ = _environment(rendered, deployment)
    assert values.get("TMPDIR", "/tmp") == "/tmp"
    concurrency = [arg.removeprefix("--concurrency=") for arg in worker["command"] if arg.startswith("--concurrency=")]
    processes = int(concurrency[0])
    size_limit = _tmp_size_limit(deployment)
    for source, spool_bytes in (("config.env", int(values["INFERPLANE_BATCH_SPOOL_BYTES"])),
                                ("the default", settings.BATCH_SPOOL_BYTES)):
        assert processes * spool_bytes + BATCH_WORKER_SCRATCH_BYTES <= size_limit, (
            f"{rendered.overlay}: {processes} batch worker processes may spool {spool_bytes / MiB:.0f} MiB each "
            f"({source}'s), with {BATCH_WORKER_SCRATCH_BYTES / MiB:.0f} MiB of scratch, past its /tmp's "
            f"{size_limit / MiB:.0f} MiB")
    assert _bytes_of(worker["resources"]["requests"]["ephemeral-storage"]) >= size_limit


def test_probes_send_a_host_the_production_settings_accept(rendered, client, settings):
    # The kubelet would send Host: <pod IP>, which ALLOWED_HOSTS refuses with a 400.
    values, _ = _environment(rendered, rendered.get("Deployment", "inferplane-web"))
    settings.ALLOWED_HOSTS = values["ALLOWED_HOSTS"].split(",")
    settings.SECURE_SSL_REDIRECT = True
    web = _pod_spec(rendered.get("Deployment", "inferplane-web"))["containers"][0]
    headers = {header["name"]: header["value"] for header in web["livenessProbe"]["httpGet"]["httpHeaders"]}
    assert client.get("/healthz", HTTP_HOST=headers["Host"]).status_code == 200
    assert client.get("/healthz", HTTP_HOST="10.1.2.3:8000").status_code == 400


def test_beat_runs_exactly_one_replica_and_never_two_at_once(rendered):
    beat = rendered.get("Deployment", "inferplane-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"
    assert not [
        hpa
        for hpa in rendered.all("HorizontalPodAutoscaler")
        if hpa["spec"]["scaleTargetRef"]["name"] == "inferplane-beat"
    ]
    assert _pod_spec(beat)["containers"][0]["command"][:3] == ["celery", "--app=controlplane", "beat"]


def test_each_worker_serves_its_metrics_on_the_port_its_pod_names_from_a_writable_folder(rendered):
    # controlplane/worker_metrics.py listens on INFERPLANE_WORKER_METRICS_PORT with the metrics token (a Secret), and
    # keeps its processes' counters in a fresh folder under the temporary directory.
    for name in ("inferplane-worker", "inferplane-batch-worker"):
        deployment = rendered.get("Deployment", name)
        values, from_secrets = _environment(rendered, deployment)
        container = _pod_spec(deployment)["containers"][0]
        (port,) = [port for port in container["ports"] if port["name"] == "metrics"]
        assert str(port["containerPort"]) == values["INFERPLANE_WORKER_METRICS_PORT"] != "0", name
        assert "INFERPLANE_METRICS_TOKEN" in from_secrets, name
        assert "/tmp" in {mount["mountPath"] for mount in container["volumeMounts"]}, name


def test_worker_and_migrations_run_the_right_commands(rendered):
    worker = _pod_spec(rendered.get("Deployment", "inferplane-worker"))["containers"][0]
    assert worker["command"][:3] == ["celery", "--app=controlplane", "worker"]
    # batch runs never take the slots of the autoscaler tick, reconciles and cold-start wakes
    assert "--queues=celery" in worker["command"]
    batch_worker = _pod_spec(rendered.get("Deployment", "inferplane-batch-worker"))["containers"][0]
    assert batch_worker["command"][:3] == ["celery", "--app=controlplane", "worker"]
    assert "--queues=batches" in batch_worker["command"]
    migrate = _pod_spec(rendered.get("Job", "inferplane-migrate"))["containers"][0]
    assert migrate["command"] == ["python", "manage.py", "migrate", "--noinput"]


WAIT_NAME = "wait-for-migrations"


def test_no_pod_of_a_release_serves_before_its_migrations_are_applied(rendered):
    """`kubectl apply -k` applies the migration Job and the Deployments together. Before, nothing held a new pod back
    while the Job ran (no init container): its code read columns the Job had not added yet, and the README's "the
    migration Job runs first" was not true.

    Beat waits for nothing: it reads no schema, and with `Recreate` its old pod is gone at once, so its wait stopped
    autoscaling, sweeps and rollups fleet-wide for a whole migration (before: beat had the init container). The wait
    is Django's `migrate --check`, which every image has: before, it ran `manage.py wait_for_migrations`, a command
    only that release had, and rolling back to an older tag left each new pod's init container failing forever."""
    for kind, name in DJANGO_PROCESSES:
        pod = _pod_spec(rendered.get(kind, name))
        waits = [container for container in pod.get("initContainers", []) if container["name"] == WAIT_NAME]
        if kind == "Job" or name == "inferplane-beat":
            assert not waits, f"{rendered.overlay} {name} waits for the migrations"  # the Job applies them
            continue
        assert len(waits) == 1, f"{rendered.overlay} {name} does not wait for its migrations"
        (wait,) = waits
        serving = pod["containers"][0]
        script = " ".join(wait["command"])
        assert wait["command"][:2] == ["sh", "-c"]
        assert "python manage.py migrate --check" in script
        assert "wait_for_migrations" not in script
        assert "deadline" in script and "exit 1" in script  # bounded: fails, and Kubernetes starts it again
        assert wait["image"] == serving["image"]
        assert (wait["envFrom"], wait["env"]) == (serving["envFrom"], serving["env"])  # the same database


def test_web_scales_horizontally_and_survives_node_drains(rendered):
    web = rendered.get("Deployment", "inferplane-web")
    assert "replicas" not in web["spec"], "the HorizontalPodAutoscaler owns the web replica count"
    hpa = rendered.get("HorizontalPodAutoscaler", "inferplane-web")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "inferplane-web",
    }
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    budgets = {pdb["metadata"]["name"]: pdb for pdb in rendered.all("PodDisruptionBudget")}
    assert set(budgets) == {"inferplane-web", "inferplane-worker", "inferplane-batch-worker"}
    for name, pdb in budgets.items():
        component = name.removeprefix("inferplane-")
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component


def test_every_container_has_requests_limits_and_runs_as_non_root(rendered):
    for resource in rendered.documents:
        if resource["kind"] not in {"Deployment", "DaemonSet", "Job"}:
            continue
        pod = _pod_spec(resource)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        agent_init = [container for container in pod.get("initContainers", []) if container["name"] != WAIT_NAME]
        for container in pod["containers"] + [c for c in pod.get("initContainers", []) if c["name"] == WAIT_NAME]:
            where = f"{rendered.overlay} {resource['metadata']['name']}/{container['name']}"
            assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), where
            assert "memory" in container["resources"]["limits"], where
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], where
        for container in agent_init:
            # The one root container: it only hands the host directories to the agent's user.
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}


def test_the_ingress_terminates_tls_for_its_host_and_routes_its_paths_to_web(rendered):
    ingress = rendered.get("Ingress", "inferplane")
    (rule,) = ingress["spec"]["rules"]
    (tls,) = ingress["spec"]["tls"]
    assert tls["hosts"] == [rule["host"]]
    assert {path["backend"]["service"]["name"] for path in rule["http"]["paths"]} == {"inferplane-web"}
    assert {path["backend"]["service"]["port"]["name"] for path in rule["http"]["paths"]} == {"http"}
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    values, _ = _environment(rendered, rendered.get("Deployment", "inferplane-web"))
    assert rule["host"] in values["ALLOWED_HOSTS"].split(",")
    assert values["INFERPLANE_PUBLIC_URL"] == f"https://{rule['host']}"
    assert values["CSRF_TRUSTED_ORIGINS"] == f"https://{rule['host']}"


def test_overlays_pin_images_and_their_own_namespace_and_host(rendered_overlays):
    hosts, namespaces = set(), set()
    for rendered in rendered_overlays.values():
        for resource in rendered.documents:
            if resource["kind"] in {"Deployment", "DaemonSet", "Job"}:
                for container in _pod_spec(resource)["containers"] + _pod_spec(resource).get(
                    "initContainers", []
                ):
                    image = container["image"]
                    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image
            if resource["kind"] != "Namespace":
                namespaces.add((rendered.overlay, resource["metadata"]["namespace"]))
        hosts.add(rendered.get("Ingress", "inferplane")["spec"]["rules"][0]["host"])
    assert len(hosts) == len(rendered_overlays)
    assert len({namespace for _, namespace in namespaces}) == len(rendered_overlays)


def test_each_overlays_pool_machines_join_that_overlays_own_control_plane(rendered):
    # Before: the base named production's host as the agents' control plane and staging never replaced it, so a
    # machine staging's node pools launched registered with production (and staging's demand never met).
    from urllib.parse import urlsplit

    host = rendered.get("Ingress", "inferplane")["spec"]["rules"][0]["host"]
    for kind, name in DJANGO_PROCESSES:
        values, _ = _environment(rendered, rendered.get(kind, name))
        agents_url = values.get("INFERPLANE_AGENT_CONTROL_PLANE_URL") or values["INFERPLANE_PUBLIC_URL"]
        assert urlsplit(agents_url).hostname == host, f"{rendered.overlay} {name}: agents join {agents_url}"


def test_gpu_agent_runs_on_every_gpu_node_with_its_gpus_cache_and_join_token(rendered):
    agent = rendered.get("DaemonSet", "inferplane-agent")
    pod = _pod_spec(agent)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[:4] == ["python", "-m", "gpu_agent", "run"]
    assert "--control-plane=$(INFERPLANE_PUBLIC_URL)" in args and "--data-dir=/var/lib/inferplane" in args
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus >= 1 and container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    env = {variable["name"]: variable for variable in container["env"]}
    token = env["INFERPLANE_JOIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["name"] == "inferplane-agent" and not token.get("optional")
    for optional in ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3"):
        assert env[optional]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert env["INFERPLANE_PUBLIC_URL"]["valueFrom"]["configMapKeyRef"]["name"].startswith(
        "inferplane-config-"
    )
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes[mounts["/var/lib/inferplane"]]["hostPath"]["path"] == "/var/lib/inferplane"
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert pod["terminationGracePeriodSeconds"] > 120, "longer than a replica's drain timeout"


def test_engines_writing_within_their_own_disk_bounds_never_get_the_agent_pod_and_every_engine_of_its_node_evicted(
        rendered):
    """Each engine's scratch folder (its HOME and TMPDIR) is in the agent pod's /tmp (`sandbox.make_scratch_folder`),
    and the agent lets each engine write up to INFERPLANE_AGENT_ENGINE_DISK_GB (20 GB) there and in its cache, then
    stops it alone. The kubelet evicts a pod whose emptyDir passes its size limit: the agent and every tenant's engine
    on the node go at once. Before, the /tmp limit was 32 GiB: two engines (one tenant's two replicas, or GPU-shared
    replicas of one GPU) writing 17 GB each, each within its own bound, had the whole node's pod evicted."""
    from gpu_agent.runtime.engine_disk import DEFAULT_ENGINE_MAX_BYTES

    agent = rendered.get("DaemonSet", "inferplane-agent")
    pod = _pod_spec(agent)
    (container,) = pod["containers"]
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    assert env.get("TMPDIR", "/tmp") == "/tmp"
    engine_bytes = float(env.get("INFERPLANE_AGENT_ENGINE_DISK_GB") or DEFAULT_ENGINE_MAX_BYTES / 1e9) * 1e9
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    tmp = {volume["name"]: volume for volume in pod["volumes"]}[mounts["/tmp"]]
    # Engines per node are not bounded by its GPUs (GPU sharing puts several on one): no size limit is safe but none.
    limit = tmp.get("emptyDir", {}).get("sizeLimit")
    assert limit is None, (
        f"{rendered.overlay}: the agent's /tmp is evicted at {_bytes_of(limit) / 1e9:.0f} GB, "
        f"{_bytes_of(limit) / engine_bytes:.1f} engines' bounds")
    assert "ephemeral-storage" not in container["resources"].get("limits", {})


def test_the_agent_s_weights_never_fill_the_node_s_disk_past_the_kubelet_s_eviction_threshold(rendered):
    """The weights cache (--data-dir, a hostPath) is on the node's disk, the kubelet's, where the pod's /tmp is too.
    Without a budget it filled that disk to its last byte: past the kubelet's hard threshold (imagefs.available 15 %
    and nodefs.available 10 % by default, one and the same disk on most nodes) the kubelet evicts the pod with the most
    ephemeral storage over its request, the agent's (its /tmp, which has no size limit now, so that the node's disk
    is what bounds it), every engine of the node with it; and the weights stay on the host, so every agent pod after it
    was evicted too. The agent now keeps a share of that disk free above the thresholds, room for its engines' /tmp."""
    from gpu_agent.runtime.cli import _parser

    (container,) = _pod_spec(rendered.get("DaemonSet", "inferplane-agent"))["containers"]
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    reserve = env.get("INFERPLANE_AGENT_WEIGHTS_DISK_RESERVE_PERCENT")
    assert reserve is not None, f"{rendered.overlay}: the weights cache fills the node's disk"
    assert float(reserve) > 15, reserve
    assert not [arg for arg in container["args"] if arg.startswith("--weights-disk-reserve-percent")]
    args = _parser().parse_args(["run", "--control-plane=https://x", f"--weights-disk-reserve-percent={reserve}"])
    assert args.weights_disk_reserve_percent == float(reserve)


def test_a_stopping_web_pod_has_time_to_drain_its_calls_and_bill_those_its_drain_cut(rendered, settings):
    # NOTE: and then to replay its usage journal or ship it to the bucket (`billing.journal_shipping`), which the
    # grace period did not count (the review of this stop's diff): a SIGKILL there lost what was not shipped.
    from billing.journal_shipping import ONE_PUT_BOUND_S
    from billing.usage_writer import SET_ASIDE_STOP_WAIT_S
    from endpoints.gateway.app import AFTER_GRACEFUL_S, SHUTDOWN_REPLAY_S
    from endpoints.gateway.call import SHUTDOWN_FINISH_WAIT_S
    from endpoints.gateway.drain import room_for_the_drain_s

    deployment = rendered.get("Deployment", "inferplane-web")
    pod = _pod_spec(deployment)
    (container,) = pod["containers"]
    graceful = next(int(arg.split("=", 1)[1]) for arg in container["command"] + container.get("args", [])
                    if arg.startswith("--timeout-graceful-shutdown="))
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    values, _ = _environment(rendered, deployment)
    for drain_s in (float(values["INFERPLANE_GATEWAY_DRAIN_S"]), settings.GATEWAY_DRAIN_S):
        assert pod["terminationGracePeriodSeconds"] > (pre_stop + drain_s + graceful + SHUTDOWN_FINISH_WAIT_S
                                                       + SHUTDOWN_REPLAY_S
                                                       + max(ONE_PUT_BOUND_S, SET_ASIDE_STOP_WAIT_S))
    # NOTE: the process's own cap on its stop (`drain.stop_budget_end`) is the time SIGKILL leaves it after the signal
    assert float(values["INFERPLANE_GATEWAY_STOP_GRACE_S"]) == pod["terminationGracePeriodSeconds"] - pre_stop
    # ... and the drain configured fits it with the steps after it and the exit: never cut short at a stop
    settings.GATEWAY_STOP_GRACE_S = float(values["INFERPLANE_GATEWAY_STOP_GRACE_S"])
    assert float(values["INFERPLANE_GATEWAY_DRAIN_S"]) <= room_for_the_drain_s(graceful, AFTER_GRACEFUL_S)


def test_what_a_scheduler_first_upgrade_applies_alone_is_the_migration_job_and_every_config_map_its_pod_reads(rendered):
    """infra/README.md, *Upgrading*: a release that rolls the worker and beat first applies the migration Job alone
    (`kubectl apply -l inferplane.dev/before-the-rest=true`) and waits for it, so the worker's new code never meets the
    old schema; the Job must find the settings' ConfigMap of its own content there (a new name per content), and nothing
    else may roll with it."""
    selected = {(doc["kind"], doc["metadata"]["name"]) for doc in rendered.documents
                if doc["metadata"].get("labels", {}).get("inferplane.dev/before-the-rest") == "true"}
    job = rendered.get("Job", "inferplane-migrate")
    read = {source["configMapRef"]["name"] for container in _pod_spec(job)["containers"]
            for source in container.get("envFrom", []) if "configMapRef" in source}
    assert read and selected == {("Job", "inferplane-migrate")} | {("ConfigMap", name) for name in read}
