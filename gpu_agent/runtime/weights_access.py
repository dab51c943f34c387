"""Whose credentials read a replica's model source, and what a failed read may say.

A replica's spec says how its source is read (`gpu_agent.protocol.ReplicaSpec`):
    credentials              the organisation's own: only those (S3 keys, an assumed role, a Hub token)
    use_fleet_credentials    a staff allow-listed public catalogue source: the node's own credentials
    neither                  anonymous (unsigned S3 requests, no Hub token), never the node's own

Credentials live in memory only: never in a manifest, a state file, a log line or a failure reason.

Errors shown to a customer never reveal whether someone else's bucket or repo exists: a missing
bucket, a forbidden one, a missing key and an empty listing all read the same. Only a store that
cannot be reached at all (`StoreUnreachable`) lets the cache fall back to a copy it already holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import boto3
import botocore.exceptions
import httpx
from botocore import UNSIGNED
from botocore.config import Config

from gpu_agent.protocol import ReplicaSpec, SourceCredentials, is_public_address, role_account
from gpu_agent.runtime.weights_watchdog import guard_s3_connections

logger = logging.getLogger(__name__)

# Statuses and codes that mean "the store is down or busy", not "you may not read this".
_TRANSIENT_S3_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"}
_S3_CONFIG = Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10, read_timeout=60)
_ROLE_SESSION_NAME = "inferplane-weights"
# An assumed role's keys last an hour by default: its client is replaced well before, so a download
# that starts on a cached client never runs out of time.
_ROLE_CLIENT_LIFETIME_S = 15 * 60
_MAX_CLIENTS = 64
_clients: OrderedDict[tuple, _CachedClient] = OrderedDict()
_clients_lock = threading.Lock()
# The node's own AWS account by the access key id of its credentials (STS GetCallerIdentity, asked once per key).
_MAX_NODE_ACCOUNTS = 16
_node_accounts: dict[str, str] = {}


class WeightsError(Exception):
    """A fetch failure whose message is safe to show the endpoint's owner (no secrets, no one else's facts)."""


class SourceUnreadable(WeightsError):
    """The source does not exist or these credentials cannot read it (deliberately not saying which)."""


class StoreUnreachable(WeightsError):
    """The store could not be reached: a cached copy of the same source, in the same scope, may serve."""


class ModelTooLarge(WeightsError):
    """The model can never fit this node's weights budget or disk."""


class FetchStopped(WeightsError):
    """The replica that wanted the model was drained while it downloaded: the download ends, its disk is freed."""


class UnsafeModelPath(WeightsError):
    """A file name or local path that would resolve outside its folder."""


@dataclass(slots=True, frozen=True)
class SourceAccess:
    """How one fetch reads its source, and who may share the cached copy (`scope`)."""

    credentials: SourceCredentials | None = field(default=None, repr=False)
    use_fleet_credentials: bool = False
    scope: str = ""  # "" for a public catalogue copy every tenant shares, else the owner's scope

    @classmethod
    def for_replica(cls, spec: ReplicaSpec) -> SourceAccess:
        return cls(
            credentials=spec.credentials,
            use_fleet_credentials=spec.use_fleet_credentials and spec.credentials is None,
            scope=spec.weights_scope,
        )

    @classmethod
    def for_draft(cls, spec: ReplicaSpec) -> SourceAccess:
        """A speculative draft model's: the replica's credentials, else the fleet's for a catalogue draft."""
        speculative = spec.speculative
        return cls(
            credentials=spec.credentials,
            use_fleet_credentials=speculative.draft_use_fleet_credentials and spec.credentials is None,
            scope=speculative.draft_weights_scope,
        )

    def credentials_of_kind(self, kind: str, source: str) -> SourceCredentials | None:
        if self.credentials is not None and self.credentials.kind != kind:
            raise SourceUnreadable(
                f"cannot read {source}: the endpoint's credentials are for "
                f"{'Hugging Face' if self.credentials.kind == 'hf' else 'S3'}"
            )
        return self.credentials


# A tenant's store may not be on the node's own network. The control plane refuses such addresses when a
# credential is saved (`endpoints.serializers.validate_endpoint_url`), but a public name can resolve to a
# private address, and only here is it resolved as the node resolves it. A development set-up whose stores
# are on loopback (moto, MinIO) allows them with this variable set to 1.
ALLOW_PRIVATE_STORES_ENV = "INFERPLANE_AGENT_ALLOW_PRIVATE_STORES"


def check_store_address(endpoint_url: str, source: str) -> None:
    """Refuse a tenant's store whose name resolves to any address that is not public (loopback, private,
    link-local such as the cloud metadata service, or one of those inside an IPv6 address: `is_public_address`).
    Checked before a client for it is made.

    NOTE: boto3 resolves the name again when it connects; a name that changes its answer in between
    (DNS rebinding) reaches a service that must then present a certificate for that name, which the
    node checks."""
    if os.environ.get(ALLOW_PRIVATE_STORES_ENV) == "1":
        return
    parts = urlsplit(endpoint_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        answers = socket.getaddrinfo(parts.hostname or "", port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise StoreUnreachable(f"cannot reach the store of {source}: its address does not resolve") from None
    for *_, address in answers:
        if not is_public_address(ipaddress.ip_address(address[0].split("%", 1)[0])):
            raise SourceUnreadable(f"cannot read {source}: the credential's endpoint_url resolves to an address "
                                   "on the platform's own network")


def fetch_stopped(source: str) -> FetchStopped:
    return FetchStopped(f"the download of {source} stopped: its replica is no longer wanted")


def unreadable(source: str) -> SourceUnreadable:
    return SourceUnreadable(
        f"cannot read {source}: it does not exist or the endpoint's credentials cannot read it"
    )


# -- S3 --------------------------------------------------------------------------------------


def s3_endpoint_for(access: SourceAccess, default_endpoint_url: str | None) -> str | None:
    credentials = access.credentials
    return (
        credentials.endpoint_url if credentials and credentials.kind == "s3" else ""
    ) or default_endpoint_url


@contextlib.contextmanager
def s3_client(access: SourceAccess, source: str, *, default_endpoint_url: str | None) -> Iterator[object]:
    """The process's client for exactly the credentials `access` allows (made once, then shared), lent for the
    `with` block.

    boto3 clients are thread-safe and hold the connection pool, so every fetch and every download
    thread reading with the same credentials from the same store shares one. Clients are keyed by
    a digest of the credentials (never the secrets themselves); a client signed with an assumed
    role's temporary keys is replaced before those expire. A client dropped from the cache (past
    `_MAX_CLIENTS`, or replaced) is closed at once, or by the last block still using it.

    NOTE: dropped and left to the garbage collector (a boto3 client is a web of cycles), its pooled
    connections stayed open, a socket each, for as long as the collector took to find it.
    """
    credentials = access.credentials_of_kind("s3", source)
    endpoint_url = s3_endpoint_for(access, default_endpoint_url)
    region = (credentials.region if credentials else "") or None
    identity = _client_identity(access, credentials, endpoint_url, region)
    with _clients_lock:
        lent = _clients.get(identity)
        if lent is not None and lent.expires_at > time.monotonic():
            _clients.move_to_end(identity)
            lent.num_users += 1
        else:
            lent = None
    if lent is None:
        if credentials is not None and credentials.endpoint_url and credentials.endpoint_url != default_endpoint_url:
            check_store_address(credentials.endpoint_url, source)  # the node's own store is the operator's
        client, lifetime_s = _new_s3_client(access, credentials, endpoint_url, region, source)
        lent = _CachedClient(client, time.monotonic() + lifetime_s, num_users=1)
        with _clients_lock:
            dropped = [_clients.pop(identity, None)]
            _clients[identity] = lent
            while len(_clients) > _MAX_CLIENTS:
                dropped.append(_clients.popitem(last=False)[1])
            to_close = [old for old in dropped if old is not None and old.drop()]
        for old in to_close:
            old.close()
    try:
        yield lent.client
    finally:
        with _clients_lock:
            lent.num_users -= 1
            close = lent.dropped and lent.num_users == 0
        if close:
            lent.close()


def drop_clients_except(credentials) -> int:
    """Let go of every cached client signed with an organisation's credentials that are not among `credentials` (those
    of the node's desired replicas and their adapters, `Agent.heartbeat_once`); the fleet's and the anonymous clients
    stay. Each is closed at once, or by the last block still using it. Returns how many were let go.

    NOTE: before, a client built from a credential stayed cached (up to `_MAX_CLIENTS`, for the agent's life) after the
    credential was deleted or rotated: its keys in boto3's memory, and a fetch made with the same old keys, or a
    role's client within its lifetime, was served by it without another word from the control plane."""
    kept = {_credentials_digest(c) for c in credentials if c is not None and c.kind == "s3"}
    kept |= {_material_digest("fleet"), _material_digest("anonymous")}
    with _clients_lock:
        gone = [identity for identity in _clients if identity[0] not in kept]
        to_close = [lent for lent in (_clients.pop(identity) for identity in gone) if lent.drop()]
    for lent in to_close:
        lent.close()
    return len(gone)


@dataclass(slots=True)
class _CachedClient:
    """One cached S3 client, how many `with` blocks use it now, and whether the cache has let it go."""

    client: object
    expires_at: float
    num_users: int = 0
    dropped: bool = False

    def drop(self) -> bool:
        """Under `_clients_lock`: let it go; True when nobody uses it, so the caller closes it now."""
        self.dropped = True
        return self.num_users == 0

    def close(self) -> None:
        """Close its connections; a failure is logged, never raised. NOTE: raised, one dropped client's failing close
        failed the unrelated fetch that dropped it, before that fetch's own client was ever handed back: its use
        count never came down, and the cache never closed it."""
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - whatever botocore raises, the lender's caller must not see it
            logger.warning("closing a dropped S3 client failed", exc_info=True)


def _client_identity(access: SourceAccess, credentials, endpoint_url, region) -> tuple:
    if credentials is None:
        material = _material_digest("fleet" if access.use_fleet_credentials else "anonymous")
    else:
        material = _credentials_digest(credentials)
    return (material, endpoint_url or "", region or "")


def _credentials_digest(credentials: SourceCredentials) -> str:
    return _material_digest("\n".join((
        credentials.access_key_id, credentials.secret_access_key, credentials.session_token or "",
        credentials.role_arn or "", credentials.external_id or "",
    )))


def _material_digest(material: str) -> str:
    return hashlib.sha256(material.encode()).hexdigest()


def _new_s3_client(access: SourceAccess, credentials, endpoint_url, region, source: str):
    """A client and how long it may be reused (an assumed role's keys expire)."""
    lifetime_s = float("inf")
    config = _S3_CONFIG
    if credentials is None:
        session = boto3.session.Session(region_name=region)
        if not access.use_fleet_credentials:
            # NOTE: unsigned, so the node's own credentials are never even looked up.
            config = config.merge(Config(signature_version=UNSIGNED))
    elif credentials.role_arn:
        session = _assumed_role_session(credentials, source, region)
        lifetime_s = _ROLE_CLIENT_LIFETIME_S
    else:
        session = boto3.session.Session(
            aws_access_key_id=credentials.access_key_id,
            aws_secret_access_key=credentials.secret_access_key,
            aws_session_token=credentials.session_token or None,
            region_name=region,
        )
    client = session.client("s3", endpoint_url=endpoint_url, config=config)
    guard_s3_connections(client)  # a drain or a deadline can end its requests mid-read (`weights_watchdog`)
    return client, lifetime_s


def _assumed_role_session(credentials: SourceCredentials, source: str, region: str | None):
    """The organisation's role, assumed with the node's own credentials: only the temporary keys read the source.

    NOTE: never a role in the node's own account. If a role there trusted the node (or the account) without
    checking the external id, the tenant would read what the platform can (a confused deputy). The control plane
    refuses the platform's accounts it is told of (`INFERPLANE_PLATFORM_AWS_ACCOUNT_IDS`); the node knows its
    own account without being told, from the very credentials it would lend, so it refuses that one itself.
    """
    account = role_account(credentials.role_arn)
    if account is None:
        raise SourceUnreadable(f"cannot read {source}: the credential's role_arn is not an IAM role in an account")
    node = boto3.session.Session(region_name=region)
    sts = node.client("sts", config=_S3_CONFIG)
    arguments = {"RoleArn": credentials.role_arn, "RoleSessionName": _ROLE_SESSION_NAME}
    if credentials.external_id:
        arguments["ExternalId"] = credentials.external_id
    with s3_errors(source):
        if account == _node_account(node, sts):
            raise SourceUnreadable(
                f"cannot read {source}: the credential's role is in the platform's own AWS account, so it is never "
                "assumed; name a role in your own account"
            )
        answer = sts.assume_role(**arguments)
    temporary = answer["Credentials"]
    return boto3.session.Session(
        aws_access_key_id=temporary["AccessKeyId"],
        aws_secret_access_key=temporary["SecretAccessKey"],
        aws_session_token=temporary["SessionToken"],
        region_name=region,
    )


def _node_account(node, sts) -> str:
    """The AWS account of the node's own credentials. GetCallerIdentity needs no permission; it is asked once for
    each access key id the node's credentials have (an instance role's keys rotate, its account does not)."""
    node_credentials = node.get_credentials()
    if node_credentials is None:
        raise botocore.exceptions.NoCredentialsError()
    key = node_credentials.get_frozen_credentials().access_key
    with _clients_lock:
        account = _node_accounts.get(key)
    if account is None:
        account = sts.get_caller_identity()["Account"]
        with _clients_lock:
            if len(_node_accounts) >= _MAX_NODE_ACCOUNTS:
                _node_accounts.clear()
            _node_accounts[key] = account
    return account


@contextlib.contextmanager
def s3_errors(source: str) -> Iterator[None]:
    """Turn boto3's errors into the customer-safe ones above."""
    try:
        yield
    except WeightsError:
        raise
    except botocore.exceptions.ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code == "PreconditionFailed" or status == 412:  # IfMatch: the object is not the one listed
            raise WeightsError(
                f"{source} changed while it was downloading; the next attempt fetches the new version"
            ) from exc
        if status >= 500 or code in _TRANSIENT_S3_CODES:
            raise StoreUnreachable(
                f"cannot reach the store of {source} (it answered {status or code})"
            ) from exc
        raise unreadable(source) from exc
    except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError) as exc:
        raise StoreUnreachable(f"cannot reach the store of {source}") from exc
    except botocore.exceptions.NoCredentialsError as exc:
        raise WeightsError(
            f"cannot read {source}: this node has no credentials for the public catalogue"
        ) from exc
    except botocore.exceptions.BotoCoreError as exc:  # a malformed bucket name, an unusable endpoint...
        raise unreadable(source) from exc


# -- Hugging Face ------------------------------------------------------------------------------


def hf_client(access: SourceAccess, source: str) -> httpx.Client:
    """An HTTP client for one fetch from the Hub, carrying exactly the token `access` allows."""
    from huggingface_hub.utils import build_hf_headers

    credentials = access.credentials_of_kind("hf", source)
    if credentials is not None:
        token: str | bool | None = credentials.hf_token
    elif access.use_fleet_credentials:
        token = None  # the node's own token (HF_TOKEN or its stored login), if it has one
    else:
        token = False  # anonymous
    # NOTE: httpx drops the Authorization header when a redirect leaves the Hub's origin (its CDN). No connection
    # is kept for reuse: a download's guard sees only the connections its request opens (`weights_watchdog`), and
    # a 16 MiB range is worth its own.
    return httpx.Client(
        headers=build_hf_headers(token=token),
        follow_redirects=True,
        timeout=httpx.Timeout(60.0, connect=10.0),
        limits=httpx.Limits(max_keepalive_connections=0),
    )


def hf_raise_for_status(response: httpx.Response, source: str) -> None:
    status = response.status_code
    if status < 400:
        return
    if status >= 500 or status == 429:
        raise StoreUnreachable(f"cannot reach the Hub for {source} (it answered {status})")
    raise unreadable(source)


@contextlib.contextmanager
def hf_errors(source: str) -> Iterator[None]:
    try:
        yield
    except httpx.TransportError as exc:
        raise StoreUnreachable(f"cannot reach the Hub for {source}") from exc
