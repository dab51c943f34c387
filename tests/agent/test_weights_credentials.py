"""Whose credentials read a model: the organisation's own, the fleet's for the catalogue only, else none.

The S3 tests run against a moto server in its own process that enforces IAM, with three parties:
tenant A (keys for `tenant-a-*`), tenant B (a role in its own account that the fleet assumes, for
`tenant-b-models`) and the fleet itself (the agent's own environment keys, for `fleet-catalogue` and
`sts:AssumeRole`, in the platform's account, which also holds a role that trusts anyone).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

import boto3
import botocore.client
import httpx
import pytest
from botocore.exceptions import ClientError

from gpu_agent.protocol import SourceCredentials
from gpu_agent.runtime.engine import free_port
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import SourceAccess, SourceUnreadable, StoreUnreachable

from .test_weights_cache import s3, s3_endpoint, upload_model  # noqa: F401  (fixtures)
from .test_weights_hf import FakeHub

TENANT_B_ACCOUNT = "210987654321"  # moto's own default account, 123456789012, is the platform's here


@dataclass
class IamStore:
    url: str
    tenant_a: tuple[str, str]
    fleet: tuple[str, str]
    tenant_b_role: str
    platform_role: str

    def keys(self, pair: tuple[str, str], **extra) -> SourceCredentials:
        return SourceCredentials(
            kind="s3",
            access_key_id=pair[0],
            secret_access_key=pair[1],
            region="us-east-1",
            endpoint_url=self.url,
            **extra,
        )


def _policy(*statements) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


def _s3_allow(*patterns: str) -> dict:
    resources = [f"arn:aws:s3:::{p}" for p in patterns] + [f"arn:aws:s3:::{p}/*" for p in patterns]
    return {"Effect": "Allow", "Action": "s3:*", "Resource": resources}


@pytest.fixture(scope="module")
def iam_store():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/moto-api/", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        admin = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "setup",
                 "aws_secret_access_key": "setup"}  # fmt: skip
        iam, s3_admin = boto3.client("iam", **admin), boto3.client("s3", **admin)
        for bucket in ("tenant-a-models", "tenant-b-models", "fleet-catalogue"):
            s3_admin.create_bucket(Bucket=bucket)
            s3_admin.put_object(Bucket=bucket, Key="m/config.json", Body=f'{{"owner": "{bucket}"}}'.encode())

        def user(name: str, *statements) -> tuple[str, str]:
            iam.create_user(UserName=name)
            iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=_policy(*statements))
            key = iam.create_access_key(UserName=name)["AccessKey"]
            return key["AccessKeyId"], key["SecretAccessKey"]

        tenant_a = user("tenant-a", _s3_allow("tenant-a-*"))
        fleet = user(
            "fleet",
            _s3_allow("fleet-catalogue"),
            {"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"},
        )
        # NOTE: moto checks no trust policy nor external id, as a careless role in the platform's account would not.
        trust = _policy({"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"})
        tenant_b_iam = boto3.client("iam", **admin)
        tenant_b_iam.meta.events.register(
            "before-sign.iam.*", lambda request, **_: request.headers.__setitem__("x-moto-account-id", TENANT_B_ACCOUNT)
        )
        role = tenant_b_iam.create_role(RoleName="tenant-b-reader", AssumeRolePolicyDocument=trust)["Role"]["Arn"]
        tenant_b_iam.put_role_policy(
            RoleName="tenant-b-reader", PolicyName="p", PolicyDocument=_policy(_s3_allow("tenant-b-models"))
        )
        platform_role = iam.create_role(RoleName="platform-reader", AssumeRolePolicyDocument=trust)["Role"]["Arn"]
        iam.put_role_policy(RoleName="platform-reader", PolicyName="p", PolicyDocument=_policy(_s3_allow("*")))
        httpx.post(f"{url}/moto-api/reset-auth", content=b"0")  # from now on every request is checked
        yield IamStore(url=url, tenant_a=tenant_a, fleet=fleet, tenant_b_role=role, platform_role=platform_role)
    finally:
        server.terminate()
        server.wait(timeout=20)


@pytest.fixture
def fleet_environment(iam_store, monkeypatch):
    """The agent's own credentials, as on a fleet node."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", iam_store.fleet[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", iam_store.fleet[1])
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", iam_store.url)


def owner(path) -> str:
    return json.loads((path / "config.json").read_text())["owner"]


def test_organisation_keys_read_their_own_bucket_and_nothing_the_fleet_could(
    iam_store, fleet_environment, tmp_path
):
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=iam_store.url)
    own = SourceAccess(credentials=iam_store.keys(iam_store.tenant_a), scope="org-a")
    assert owner(cache.fetch("s3://tenant-a-models/m", access=own)) == "tenant-a-models"
    # The node's own keys can read the catalogue, but a replica with credentials uses only those.
    with pytest.raises(SourceUnreadable):
        cache.fetch("s3://fleet-catalogue/m", access=own)
    with pytest.raises(SourceUnreadable):
        cache.fetch("s3://tenant-b-models/m", access=own)
    assert cache.num_downloads == 1


def test_a_forbidden_bucket_a_missing_one_and_an_empty_prefix_read_the_same(iam_store, tmp_path):
    cache = WeightsCache(tmp_path / "weights")
    own = SourceAccess(credentials=iam_store.keys(iam_store.tenant_a), scope="org-a")
    messages = set()
    for source in (
        "s3://tenant-b-models/m",  # exists, someone else's: 403
        "s3://tenant-a-missing/m",  # within tenant A's policy, does not exist: NoSuchBucket
        "s3://no-such-bucket-anywhere/m",
        "s3://tenant-a-models/nothing-here",  # an empty listing
    ):
        with pytest.raises(SourceUnreadable) as failure:
            cache.fetch(source, access=own)
        messages.add(str(failure.value).replace(source, "<source>"))
    assert messages == {
        "cannot read <source>: it does not exist or the endpoint's credentials cannot read it"
    }


def test_a_role_is_assumed_with_the_nodes_keys_and_only_its_temporary_keys_read(
    iam_store, fleet_environment, tmp_path
):
    fleet_s3 = boto3.client("s3", endpoint_url=iam_store.url, region_name="us-east-1")
    with pytest.raises(ClientError):  # the fleet itself cannot read tenant B's bucket
        fleet_s3.list_objects_v2(Bucket="tenant-b-models")
    role = SourceCredentials(
        kind="s3", role_arn=iam_store.tenant_b_role, external_id="org-b-external", endpoint_url=iam_store.url
    )
    cache = WeightsCache(tmp_path / "weights")
    access = SourceAccess(credentials=role, scope="org-b")
    assert owner(cache.fetch("s3://tenant-b-models/m", access=access)) == "tenant-b-models"
    for source in ("s3://fleet-catalogue/m", "s3://tenant-a-models/m"):
        with pytest.raises(SourceUnreadable):
            cache.fetch(source, access=access)


def test_a_role_in_the_nodes_own_account_is_never_assumed_whatever_its_trust_policy(
    iam_store, fleet_environment, tmp_path, monkeypatch
):
    # A tenant named a role in the platform's account that trusts anyone: the node assumed it with its own keys and
    # the tenant read every bucket the role could (here, all of them), tenant A's included.
    assert iam_store.platform_role.startswith("arn:aws:iam::123456789012:role/")
    calls = []
    make_api_call = botocore.client.BaseClient._make_api_call

    def recorded(client, operation_name, api_params):
        calls.append(operation_name)
        return make_api_call(client, operation_name, api_params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", recorded)
    role = SourceCredentials(
        kind="s3", role_arn=iam_store.platform_role, external_id="org-b-external", endpoint_url=iam_store.url
    )
    cache = WeightsCache(tmp_path / "weights")
    with pytest.raises(SourceUnreadable, match="role is in the platform's own AWS account"):
        cache.fetch("s3://tenant-a-models/m", access=SourceAccess(credentials=role, scope="org-b"))
    assert "AssumeRole" not in calls and "ListObjectsV2" not in calls
    assert cache.num_downloads == 0
    # The same node still assumes a role in the tenant's own account.
    tenant_role = SourceCredentials(
        kind="s3", role_arn=iam_store.tenant_b_role, external_id="org-b-external", endpoint_url=iam_store.url
    )
    assert iam_store.tenant_b_role.startswith(f"arn:aws:iam::{TENANT_B_ACCOUNT}:role/")
    fetched = cache.fetch("s3://tenant-b-models/m", access=SourceAccess(credentials=tenant_role, scope="org-b"))
    assert owner(fetched) == "tenant-b-models"


def test_fleet_credentials_serve_catalogue_sources_only_when_the_spec_says_so(
    iam_store, fleet_environment, tmp_path
):
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=iam_store.url)
    catalogue = SourceAccess(use_fleet_credentials=True)
    assert owner(cache.fetch("s3://fleet-catalogue/m", access=catalogue)) == "fleet-catalogue"
    with pytest.raises(SourceUnreadable):
        cache.fetch("s3://tenant-a-models/m", access=catalogue)


def test_without_credentials_a_private_object_is_read_anonymously_and_refused(s3, s3_endpoint, tmp_path):  # noqa: F811
    upload_model(s3, "private-models", "m", num_bytes=100, public=False)  # the agent's env keys could read it
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    with pytest.raises(SourceUnreadable, match="cannot read s3://private-models/m: it does not exist"):
        cache.fetch("s3://private-models/m")
    assert cache.fetch("s3://private-models/m", access=SourceAccess(use_fleet_credentials=True)).is_dir()


def test_bad_credentials_never_get_a_cached_copy(iam_store, tmp_path):
    cache = WeightsCache(tmp_path / "weights")
    good = SourceAccess(credentials=iam_store.keys(iam_store.tenant_a), scope="org-a")
    path = cache.fetch("s3://tenant-a-models/m", access=good)
    bogus_keys = iam_store.keys(("AKIABOGUSBOGUSBOGUS1", "not-the-secret"))
    for scope in ("org-b", "org-a"):  # another tenant, or the owner's own scope with wrong keys
        with pytest.raises(SourceUnreadable):
            cache.fetch("s3://tenant-a-models/m", access=SourceAccess(credentials=bogus_keys, scope=scope))
    # Unreachable: only the same scope, from the same store, falls back to what it fetched before.
    dead = SourceCredentials(
        kind="s3", access_key_id="x", secret_access_key="y", endpoint_url=f"http://127.0.0.1:{free_port()}"
    )
    with pytest.raises(StoreUnreachable):
        cache.fetch("s3://tenant-a-models/m", access=SourceAccess(credentials=dead, scope="org-b"))
    assert cache.fetch("s3://tenant-a-models/m", access=good) == path


def test_two_organisations_never_share_a_private_copy_but_the_catalogue_is_shared(s3, s3_endpoint, tmp_path):  # noqa: F811
    upload_model(s3, "shared-name", "m", num_bytes=1000)
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    a = cache.fetch("s3://shared-name/m", access=SourceAccess(scope="org-a"))
    b = cache.fetch("s3://shared-name/m", access=SourceAccess(scope="org-b"))
    assert a != b and cache.num_downloads == 2
    assert cache.fetch("s3://shared-name/m", access=SourceAccess(scope="org-a")) == a
    public = cache.fetch("s3://shared-name/m", access=SourceAccess(use_fleet_credentials=True))
    assert cache.fetch("s3://shared-name/m") == public  # "" scope: one copy for every tenant
    assert cache.num_downloads == 3 and cache.num_hits == 2


def test_hub_token_is_the_replicas_own_or_the_fleets_for_the_catalogue_or_none(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_TOKEN", "hf_fleet_token")
    hub = FakeHub("org/private", {"config.json": b'{"owner": "org"}'}, token="hf_org_token")
    try:
        cache = WeightsCache(tmp_path / "weights", hf_endpoint=hub.url)
        with pytest.raises(SourceUnreadable) as anonymous:
            cache.fetch("hf:org/private")
        assert hub.authorizations == [None], "an anonymous read must not send the node's token"
        with pytest.raises(SourceUnreadable) as fleet:
            cache.fetch("hf:org/private", access=SourceAccess(use_fleet_credentials=True))
        assert hub.authorizations[-1] == "Bearer hf_fleet_token"
        hub.authorizations.clear()
        own = SourceAccess(credentials=SourceCredentials(kind="hf", hf_token="hf_org_token"), scope="org")
        assert owner(cache.fetch("hf:org/private", access=own)) == "org"
        assert set(hub.authorizations) == {"Bearer hf_org_token"}
    finally:
        hub.server.shutdown()
    missing = FakeHub("org/other", {})
    try:
        with pytest.raises(SourceUnreadable) as not_there:
            WeightsCache(tmp_path / "weights", hf_endpoint=missing.url).fetch("hf:org/private")
    finally:
        missing.server.shutdown()
    assert str(anonymous.value) == str(fleet.value) == str(not_there.value)


@pytest.mark.parametrize("host", ["64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "2002:a00:5::1", "::127.0.0.1",
                                  "64:ff9b:1::a00:5", "::ffff:0:7f00:1", "fec0::1"])
def test_a_tenants_store_at_an_ipv6_spelling_of_an_internal_ipv4_address_is_refused_before_any_connection(
        s3, s3_endpoint, tmp_path, monkeypatch, host):  # noqa: F811
    """A NAT64 gateway (a cloud's, for IPv6-only subnets) forwards 64:ff9b::10.0.0.5 to 10.0.0.5 on the node's own
    network; 6to4 and IPv4-compatible addresses carry one too. Python calls them all global: before, the agent
    connected (a name of the tenant's may resolve to one, whatever the control plane checked when it was saved)."""
    monkeypatch.delenv("INFERPLANE_AGENT_ALLOW_PRIVATE_STORES")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    tenant = SourceCredentials(kind="s3", access_key_id="AKIATENANT0000000001", secret_access_key="s",
                               endpoint_url=f"https://[{host}]:9000")
    with pytest.raises(SourceUnreadable) as refused:
        cache.fetch("s3://tenant-models/m", access=SourceAccess(credentials=tenant, scope="org-1"))
    assert str(refused.value) == ("cannot read s3://tenant-models/m: the credential's endpoint_url resolves to an "
                                  "address on the platform's own network")
    assert cache.num_downloads == 0


def test_a_tenants_store_whose_name_resolves_into_the_nodes_network_is_refused_before_any_connection(
        s3, s3_endpoint, tmp_path, monkeypatch):  # noqa: F811
    """The control plane refuses private addresses when a credential is saved, but a public-looking name
    may resolve to one (`localhost` here; a tenant's DNS record elsewhere). Before, the agent connected."""
    monkeypatch.delenv("INFERPLANE_AGENT_ALLOW_PRIVATE_STORES")
    upload_model(s3, "fleet-models", "m", num_bytes=1000)
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint)
    port = s3_endpoint.rsplit(":", 1)[1]
    for url, refusal in ((f"http://localhost:{port}", SourceUnreadable),
                         ("https://no-such-store.invalid", StoreUnreachable)):
        tenant = SourceCredentials(kind="s3", access_key_id="AKIATENANT0000000001", secret_access_key="s",
                                   endpoint_url=url)
        with pytest.raises(refusal) as refused:
            cache.fetch("s3://fleet-models/m", access=SourceAccess(credentials=tenant, scope="org-1"))
        assert "own network" in str(refused.value) or "does not resolve" in str(refused.value)
    assert cache.num_downloads == 0
    # The node's own store (the operator's choice) is not a tenant's: it may be on the node's network.
    own = SourceCredentials(kind="s3", access_key_id="AKIATENANT0000000001", secret_access_key="s",
                            endpoint_url=s3_endpoint)
    cache.fetch("s3://fleet-models/m", access=SourceAccess(credentials=own, scope="org-1"))
