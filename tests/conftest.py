"""Shared fixtures: API clients per role, live processes (ASGI server, Celery worker) on the test database."""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.test import Client
from rest_framework.test import APIClient

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Role, Scope
from controlplane.accounts.services import Actor
from tests.engines import engine_node as start_engine_node
from tests.engines import serve_engine, shared_engine_spec
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, sign_in_staff
from tests.processes import ChildProcess, free_port, wait_until  # noqa: F401 - shared with benchmarks
from tests.web_zygote import WebZygote

pytest_plugins = [
    "tests.ci_skips",
    "tests.child_logs",
    "tests.timeline",
    "tests.split",
    "tests.database_reset",
    "tests.worker_exit",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS_DIR = REPO_ROOT / "tests" / "artifacts"


@pytest.fixture(autouse=True, scope="session")
def _close_stray_connections(django_db_setup):
    """Connections that outlive their event loop or worker thread (the ledger writer's own, Django's
    in the threads of `asyncio.run`'s executors) close before the test database is dropped."""
    yield
    import asyncio
    import gc

    from asgiref.sync import sync_to_async
    from django.db import connections

    from billing import usage_writer

    usage_writer.close_all()
    # NOTE: thread-sensitive `sync_to_async` outside `async_to_sync` runs in one long-lived thread.
    asyncio.run(sync_to_async(connections.close_all)())
    gc.collect()


@pytest.fixture(autouse=True)
def _clean_redis(request):
    """Each test starts with an empty Redis database (counters, rate limits, broker queues), answering as far as this
    process knows (an earlier test's silent Redis left no circuit open, `controlplane.redis_circuit`)."""
    from controlplane.redis_circuit import circuit
    from controlplane.redis_client import get_redis
    from endpoints.gateway import traffic

    circuit.close()
    get_redis().flushdb()
    # NOTE: and no endpoint noted as called in this process by an earlier test: the next in-process heartbeat wrote
    # it into this test's Redis (an earlier test's endpoint id in `RECENT_ENDPOINTS_KEY`, "149", failed a tick here)
    traffic.take_recent()
    yield


@pytest.fixture(autouse=True)
def _forget_refused_credentials():
    """Each test starts with no credential remembered as refused (`controlplane.credential_lookups`)."""
    from controlplane.accounts.keys import API_KEY_LOOKUPS
    from endpoints.fleet.services import JOIN_TOKEN_LOOKUPS, NODE_SECRET_LOOKUPS
    from endpoints.gateway.auth import _session_lookups

    for lookups in (API_KEY_LOOKUPS, JOIN_TOKEN_LOOKUPS, NODE_SECRET_LOOKUPS, _session_lookups):
        lookups.clear()
    yield


@pytest.fixture(autouse=True)
def _no_stop_bound_on_shipping():
    """No test's process is stopping: a stop's bound on the usage journal's uploads (`stop_shipping_by`) ends with
    the test that set it."""
    from billing import journal_shipping

    yield
    journal_shipping._stopping_by = None


@pytest.fixture
def org():
    return OrganizationFactory()


@pytest.fixture
def member_client_factory(db):
    """Make an APIClient authenticated by an API key of a user with the given role in `organization`."""

    def make(organization, role=Role.OWNER, scopes=(Scope.MANAGE, Scope.INFERENCE)):
        user = UserFactory()
        # The key is minted while its creator is an owner, then the role becomes the one asked for:
        # a key always acts with its creator's current role.
        membership = MembershipFactory(organization=organization, user=user, role=Role.OWNER)
        created = create_api_key(Actor(user=user), organization, name=f"{role} key", scopes=list(scopes))
        membership.role = role
        membership.save(update_fields=["role"])
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {created.plain}")
        client.user, client.organization, client.plain_key = user, organization, created.plain
        return client

    return make


@pytest.fixture
def owner_client(org, member_client_factory):
    return member_client_factory(org, Role.OWNER)


def child_env() -> dict[str, str]:
    """Environment that points a child process at the test database (pytest-django renamed it)."""
    db = settings.DATABASES["default"]
    host = db["HOST"]
    url = f"postgresql://{db['USER'] or 'postgres'}@/{db['NAME']}?host={host}" if host.startswith("/") else (
        f"postgresql://{db['USER']}:{db['PASSWORD']}@{host}:{db['PORT'] or 5432}/{db['NAME']}"
    )
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": url,
        "REDIS_URL": settings.REDIS_URL,
        "PYTHONUNBUFFERED": "1",
    }


# What production needs to start a web server with debug mode off: then a failed request gets the project's error
# handlers (`handler500`), not Django's debug page.
PRODUCTION_WEB_ENV = {
    "DJANGO_DEBUG": "0",
    "DJANGO_SECRET_KEY": "k3y-" + "x9Q!z" * 12,
    "INFERPLANE_ENCRYPTION_KEYS": "YnVpbGQtdGltZS1wbGFjZWhvbGRlci1uZXZlci11c2U=",
    "ALLOWED_HOSTS": "127.0.0.1",
    "SECURE_SSL_REDIRECT": "0",
    "INFERPLANE_NODE_NETWORKS": "10.0.0.0/8",
}


def start_web_server(tmp_dir: Path, *, name: str = "web", extra_env: dict | None = None, workers: int = 1,
                     server_args: tuple[str, ...] = (), zygote: WebZygote | None = None,
                     launcher: bool = False) -> tuple[ChildProcess, str]:
    """A web server on the test database: one uvicorn process, or with `workers` > 1 (or `launcher`) the production
    launcher (`controlplane.serve`) running that many gateway processes on one port. With `zygote` the process
    is forked from it, or from its sibling for `extra_env` (`WebZygote.for_env`), imports done."""
    port = free_port()
    env = child_env() | (extra_env or {})
    if zygote is not None and workers == 1 and not server_args and not launcher:
        child = zygote.for_env(env).fork(port, tmp_dir / f"{name}.log")
    else:
        launched = workers > 1 or launcher
        server = ["controlplane.serve", "--workers", str(workers)] if launched else ["uvicorn", "controlplane.asgi:application"]
        child = ChildProcess(
            [sys.executable, "-m", *server, "--host", "127.0.0.1", "--port", str(port),
             "--no-access-log", "--log-level", "warning", *server_args],
            env, tmp_dir / f"{name}.log",
        )
    base_url = f"http://127.0.0.1:{port}"

    def healthy():
        if child.process.poll() is not None:
            raise AssertionError(f"{name} exited early:\n{child.log_tail()}")
        try:
            return httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    # NOTE: polled every 50 ms: a forked server answers ~0.1 s after its fork, and hundreds of tests start one.
    wait_until(healthy, 60, interval_s=0.05, message=f"{name} to answer /healthz")
    return child, base_url


def start_celery_worker(tmp_dir: Path, *, name: str = "worker", extra_env: dict | None = None) -> ChildProcess:
    env = child_env() | (extra_env or {})
    return ChildProcess(
        [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool=solo", "--concurrency=1",
         "--loglevel=INFO", "--without-gossip", "--without-mingle", "-n", f"{name}-{os.getpid()}@%h"],
        env, tmp_dir / f"{name}.log",
    )


@pytest.fixture(scope="session")
def web_zygote(django_db_setup, django_db_blocker, tmp_path_factory):
    """The session's fork server for web servers (`tests.web_zygote`)."""
    zygote = WebZygote(child_env(), tmp_path_factory.mktemp("web-zygote"))
    yield zygote
    zygote.stop()


@pytest.fixture
def live_server_url(transactional_db, tmp_path, web_zygote):
    """A real ASGI server (uvicorn) in a child process of its own, on the test database."""
    child, base_url = start_web_server(tmp_path, zygote=web_zygote)
    yield base_url
    child.stop()


@pytest.fixture
def celery_worker(transactional_db, tmp_path):
    child = start_celery_worker(tmp_path)
    yield child
    # NOTE: no grace at the test's end: a warm shutdown took ~1.8 s of each user's teardown and waits for nothing a
    # test reads (its log is unbuffered; the next test flushes Redis); a test of the shutdown stops its worker itself.
    child.stop(timeout_s=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a locally trained tokenizer, built once per session (seconds, no download)."""
    from gpu_agent.runtime.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_embedding_model_dir(tmp_path_factory) -> Path:
    """The tiny model's embedding sibling (a bare LlamaModel, 128-wide vectors), built once per session."""
    from gpu_agent.runtime.tiny_model import build_tiny_embedding_model

    return build_tiny_embedding_model(tmp_path_factory.mktemp("tiny-embedding-model"))


# The shared engine's teardown: at its last user's teardown (`pytest_runtest_teardown`), not at the session's end.
_shared_engine = ExitStack()
_last_engine_user: list[str] = []


@pytest.fixture(scope="session")
def engine_node(tmp_path_factory):
    """This test process's engine node (`tests.engines`): a supervisor whose zygote forks every real vLLM
    engine the tests start outside an agent, in about a second each once it has imported vLLM."""
    with start_engine_node(tmp_path_factory.mktemp("engine-node")) as node:
        yield node


@pytest.fixture(scope="session")
def vllm_engine(engine_node, tiny_model_dir) -> str:
    """The address of the one real vLLM chat engine (`tests.engines.shared_engine_spec`) the gateway's
    and the batches' vLLM modules share: started on first use, stopped after the last test using it."""
    with _shared_engine:
        yield _shared_engine.enter_context(
            serve_engine(engine_node, shared_engine_spec(tiny_model_dir), tiny_model_dir)).address


def pytest_collection_finish(session):
    users = [item.nodeid for item in session.items if "vllm_engine" in getattr(item, "fixturenames", ())]
    _last_engine_user[:] = users[-1:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # NOTE: a session fixture lives to the session's end; its engine (GiBs, a CPU hog at exit) need not.
    if _last_engine_user and item.nodeid == _last_engine_user[0]:
        _shared_engine.close()


def vllm_processes_of(replica_id: str) -> list:
    """Live processes (engine and its children) started for one replica, found by the agent's env marker."""
    import psutil

    from gpu_agent.runtime.engine import REPLICA_ENV_MARKER

    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if process.environ().get(REPLICA_ENV_MARKER) == replica_id and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def start_agent(tmp_dir: Path, control_plane_url: str, join_token: str, *, name: str = "agent") -> ChildProcess:
    return ChildProcess(
        [sys.executable, "-m", "gpu_agent", "run", "--control-plane", control_plane_url, "--join-token", join_token,
         "--data-dir", str(tmp_dir / name), "--cpu", "--name", name],
        {**os.environ, "PYTHONUNBUFFERED": "1"}, tmp_dir / f"{name}.log",
    )


def start_celery_beat(tmp_dir: Path, *, extra_env: dict | None = None) -> ChildProcess:
    env = child_env() | (extra_env or {})
    return ChildProcess(
        [sys.executable, "-m", "celery", "-A", "controlplane", "beat", "--loglevel=INFO",
         "--schedule", str(tmp_dir / "celerybeat-schedule")],
        env, tmp_dir / "beat.log",
    )


@pytest.fixture
def staff_client():
    """A browser signed in as staff (a superuser who passed the second factor); its user is `client.staff`."""
    staff = UserFactory(is_staff=True, is_superuser=True)
    client = Client()
    sign_in_staff(client, staff)
    client.staff = staff
    return client
