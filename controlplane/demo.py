"""The local demo that `make run` seeds: an organisation, a staff admin with its authenticator (the second
factor staff pass before staff pages open), an API key, a join token (for an agent started by hand), the
`local` node pool whose policy starts the CPU agent, and an endpoint serving a tiny model built on this machine.

Its secrets are kept (mode 600) in the data folder so that a second `make run`
prints the same working login and key instead of minting new ones.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from django_otp.oath import TOTP
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane.accounts.keys import find_api_key
from controlplane.accounts.models import ApiKey, Organization
from controlplane.accounts.services import SYSTEM
from controlplane.accounts.signup import bootstrap_organization
from endpoints.fleet.pool_release import release_stopped_machines
from endpoints.fleet.pool_services import create_node_pool, update_node_pool
from endpoints.fleet.providers import get_provider
from endpoints.fleet.services import create_join_token
from endpoints.models import Endpoint
from endpoints.nodes.models import JoinToken, NodePool, PoolProvider
from endpoints.services import create_endpoint

DEMO_ORG = "demo"
DEMO_EMAIL = "admin@inferplane.local"
DEMO_ENDPOINT = "tiny-chat"
DEMO_POOL = "local"
# The demo pool: one machine always (the demo endpoint keeps a replica), a second on demand,
# released after five idle minutes. Its limits are restored by every `make run` (`--no-agent` sets
# them to 0).
DEMO_POOL_LIMITS = {"min_nodes": 1, "max_nodes": 2, "warm_nodes": 0, "idle_timeout_s": 300}
# What an agent in CPU mode offers its engines of the host's memory (gpu_agent's CPU_ENGINE_MEMORY_FRACTION).
CPU_ENGINE_MEMORY_FRACTION = 0.6


@dataclass(slots=True)
class DemoSecrets:
    password: str
    api_key: str
    join_token: str
    totp_key: str  # the admin's authenticator (hex, as django-otp keeps it): `manage.py demo_code` reads it


def seed_authenticator(owner, stored_key: str | None) -> TOTPDevice:
    """The demo admin's confirmed TOTP device, with the key `demo.json` keeps (a new one the first time, or
    after an operator's reset), so that `manage.py demo_code` prints the codes it takes."""
    device = TOTPDevice.objects.filter(user=owner, confirmed=True).first()
    if device is None or (stored_key and device.key != stored_key):
        TOTPDevice.objects.filter(user=owner).delete()
        fields = {"key": stored_key} if stored_key else {}
        device = TOTPDevice.objects.create(user=owner, name="demo (make run)", confirmed=True, **fields)
    return device


def current_code(totp_key: str) -> tuple[str, int]:
    """The demo admin's code now, and the seconds it has left."""
    totp = TOTP(bytes.fromhex(totp_key))
    return f"{totp.token():06d}", int(totp.step - (totp.time - totp.t0) % totp.step)


def build_tiny_model(models_dir: Path) -> Path:
    path = models_dir / "tiny-llama"
    if not (path / "config.json").exists():
        # NOTE: its output (a progress bar, the path) kept off make run's, where it read as something to act on; shown
        # only should the build fail.
        built = subprocess.run([sys.executable, "-m", "gpu_agent", "tiny-model", str(path)],
                               capture_output=True, text=True)
        if built.returncode:
            raise RuntimeError(f"building the demo's tiny model in {path} failed:\n{built.stdout}{built.stderr}")
    return path


def host_engine_memory_mb() -> int:
    """What a local CPU agent will report as its engines' memory, so the pool plans with the real size."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1024, int(total / (1024 * 1024) * CPU_ENGINE_MEMORY_FRACTION))


def seed_local_pool(*, enabled: bool) -> NodePool:
    """The `local` pool, whose policy starts this machine's CPU agent; disabled (max 0) for `--no-agent`.

    Agents `make stop` stopped leave at once, their replicas replaced: their nodes were READY on record, and the
    printed curl got 502 for about two minutes, until the sweeper judged them silent."""
    limits = DEMO_POOL_LIMITS if enabled else {"min_nodes": 0, "max_nodes": 0, "warm_nodes": 0}
    pool = NodePool.objects.filter(name=DEMO_POOL).first()
    if pool is None:
        return create_node_pool(SYSTEM, name=DEMO_POOL, gpu_type="cpu", provider=PoolProvider.LOCAL, template={},
                                gpu_memory_mb=host_engine_memory_mb(), join_deadline_s=300, hourly_price=0, **limits)
    pool = update_node_pool(SYSTEM, pool, **limits)
    if pool.provider == PoolProvider.LOCAL:  # staff may have moved it to a cloud: heartbeats judge those machines
        release_stopped_machines(pool, get_provider(pool.provider), "its agent is not running (stopped by make stop?)",
                                 timezone.now())
    return pool


def seed_demo(data_dir: Path, *, local_pool: bool = True) -> DemoSecrets:
    secrets_file = data_dir / "demo.json"
    stored = json.loads(secrets_file.read_text()) if secrets_file.exists() else {}
    User = get_user_model()

    with transaction.atomic():
        password = stored.get("password") or secrets.token_urlsafe(12)
        api_key = stored.get("api_key")
        if not Organization.objects.filter(slug=DEMO_ORG).exists() or not api_key or find_api_key(api_key) is None:
            _, owner, created = bootstrap_organization(slug=DEMO_ORG, owner_email=DEMO_EMAIL, name="Demo", password=password)
            api_key = created.plain
            ApiKey.objects.filter(pk=created.api_key.pk).update(name="demo (make run)")
        owner = User.objects.get(username=DEMO_EMAIL)
        if not owner.check_password(password):
            owner.set_password(password)
        owner.is_staff = owner.is_superuser = True
        owner.save()
        totp_key = seed_authenticator(owner, stored.get("totp_key")).key

        join_token = stored.get("join_token")
        if not join_token or not JoinToken.objects.filter(lookup=join_token.split("_")[1], revoked_at__isnull=True).exists():
            join_token = create_join_token(SYSTEM, name="local agent (make run)").plain

    model_path = build_tiny_model(data_dir / "models")
    organization = Organization.objects.get(slug=DEMO_ORG)
    if not Endpoint.objects.for_org(organization).filter(name=DEMO_ENDPOINT).exists():
        create_endpoint(
            SYSTEM, organization, name=DEMO_ENDPOINT, model_source=str(model_path), gpu_type="cpu",
            min_replicas=1, max_replicas=2, idle_timeout_s=300, target_concurrency=8,
            max_model_len=1024, max_num_seqs=16, cold_start_timeout_s=300,
        )

    seed_local_pool(enabled=local_pool)

    result = DemoSecrets(password=password, api_key=api_key, join_token=join_token, totp_key=totp_key)
    secrets_file.write_text(json.dumps(asdict(result)))
    secrets_file.chmod(0o600)
    return result
