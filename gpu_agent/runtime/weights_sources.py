"""Where model weights come from: parsing a model source, listing its files, downloading each one.

Sources:
    s3://bucket/prefix       boto3; listed with the objects' keys, sizes and ETags
    hf:org/name[@revision]   the Hub's HTTP API; listed at the commit the revision points at
    /absolute/path           used in place, never copied (`weights_paths.check_local_model_dir`)

A listing names every file with its size before anything is downloaded (`weights_paths` checks the
names), so the cache can size the model against its disk budget first. A file's bytes are written
only while they stay within the size its listing announced. The cache (`weights.WeightsCache`)
decides where the files go and whether a download is needed at all; the clients and the errors a
customer may see come from `weights_access`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import quote

from gpu_agent.runtime.weights_access import (
    ModelTooLarge,
    WeightsError,
    hf_errors,
    hf_raise_for_status,
    s3_errors,
    unreadable,
)
from gpu_agent.runtime.weights_paths import check_model_file_names

_CHUNK_BYTES = 8 * 1024 * 1024
MAX_MODEL_FILES = 10_000  # a listing of a million tiny objects would exhaust inodes, not bytes
_HF_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(slots=True)
class ModelSource:
    kind: str  # "s3", "hf", "local"
    location: str  # bucket/prefix, org/name, or the path
    revision: str = ""

    @classmethod
    def parse(cls, source: str) -> ModelSource:
        if source.startswith("s3://"):
            rest = source[len("s3://") :].strip("/")
            if not rest:
                raise ValueError(f"bad S3 source {source!r}")
            return cls("s3", rest)
        if source.startswith("hf:"):
            name, _, revision = source[len("hf:") :].partition("@")
            if not _HF_REPO_ID.fullmatch(name) or ".." in name:
                raise ValueError(f"bad Hugging Face source {source!r}: expected hf:org/name[@revision]")
            if any(ord(ch) <= 32 or ord(ch) == 127 for ch in revision):
                raise ValueError(f"bad Hugging Face revision in {source!r}")
            return cls("hf", name, revision or "main")
        if os.path.isabs(source):
            return cls("local", source)
        raise ValueError(f"unknown model source {source!r}")

    @property
    def bucket_and_prefix(self) -> tuple[str, str]:
        bucket, _, prefix = self.location.partition("/")
        return bucket, prefix


@dataclass(slots=True, frozen=True)
class RemoteFile:
    name: str  # relative to the model folder, checked by `check_model_file_names`
    parts: tuple[str, ...]
    size_bytes: int
    location: str  # the S3 object key, or the Hub URL of the file at the listed commit
    etag: str = ""


@dataclass(slots=True)
class Download:
    """A model being downloaded: the fetchers advance it, heartbeats report it."""

    source: str
    cache_key: str
    size_bytes: int = 0
    downloaded_bytes: int = 0


def download_file(
    parsed: ModelSource, client, remote: RemoteFile, handle, download: Download, on_progress
) -> None:
    """Write one listed file into `handle`, never more bytes than its listing announced."""
    if parsed.kind == "s3":
        _download_s3_file(client, parsed, remote, handle, download, on_progress)
    else:
        _download_hf_file(client, parsed, remote, handle, download, on_progress)


def _write_chunks(chunks, remote: RemoteFile, handle, download: Download, on_progress, source: str) -> None:
    written = 0
    for chunk in chunks:
        written += len(chunk)
        download.downloaded_bytes += len(chunk)
        # NOTE: checked before writing, so a store that sends more than it listed fills no disk.
        if written > remote.size_bytes:
            raise WeightsError(
                f"{source}: {remote.name} is larger than the {remote.size_bytes} bytes its listing announced"
            )
        handle.write(chunk)
        if on_progress:
            on_progress(download.downloaded_bytes, download.size_bytes)
    if written != remote.size_bytes:
        raise WeightsError(f"{source}: {remote.name}: got {written} bytes, expected {remote.size_bytes}")


# -- S3 -------------------------------------------------------------------------


def s3_listing(client, parsed: ModelSource, source: str) -> list[RemoteFile]:
    """The objects under the prefix (every name checked, "folder" markers skipped)."""
    bucket, prefix = parsed.bucket_and_prefix
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    objects = []
    with s3_errors(source):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                size = int(item["Size"])
                if item["Key"].endswith("/") and size == 0:  # a console's "folder" marker
                    continue
                objects.append((item["Key"], size, item.get("ETag", "").strip('"')))
                if len(objects) > MAX_MODEL_FILES:
                    raise ModelTooLarge(f"{source} holds more than {MAX_MODEL_FILES} files")
    if not objects:
        raise unreadable(source)
    parts = check_model_file_names(key[len(prefix) :] for key, _, _ in objects)
    return [
        RemoteFile(name, parts[name], size, key, etag)
        for (key, size, etag), name in ((entry, entry[0][len(prefix) :]) for entry in objects)
    ]


def _download_s3_file(client, parsed, remote: RemoteFile, handle, download, on_progress) -> None:
    source = f"s3://{parsed.location}"
    bucket, _ = parsed.bucket_and_prefix
    with s3_errors(source):
        body = client.get_object(Bucket=bucket, Key=remote.location)["Body"]
        try:
            _write_chunks(body.iter_chunks(_CHUNK_BYTES), remote, handle, download, on_progress, source)
        finally:
            body.close()


# -- Hugging Face ---------------------------------------------------------------


def hub_endpoint(hf_endpoint: str | None) -> str:
    """The Hub's base URL: the configured one, else huggingface_hub's (which reads HF_ENDPOINT)."""
    from huggingface_hub import constants

    return (hf_endpoint or constants.ENDPOINT).rstrip("/")


def hf_listing(client, parsed: ModelSource, source: str, hub: str) -> tuple[list[RemoteFile], str]:
    """The repo's files at the revision (every name checked, every size known) and its commit."""
    from huggingface_hub import hf_hub_url

    url = f"{hub}/api/models/{parsed.location}/revision/{quote(parsed.revision, safe='')}"
    with hf_errors(source):
        response = client.get(url, params={"blobs": "true"})
    hf_raise_for_status(response, source)
    try:
        info = response.json()
        siblings = [(entry["rfilename"], entry.get("size")) for entry in info.get("siblings") or []]
        sha = str(info.get("sha") or parsed.revision)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise WeightsError(f"{source}: the Hub's answer about the repo is malformed") from None
    if not siblings:
        raise unreadable(source)
    if len(siblings) > MAX_MODEL_FILES:
        raise ModelTooLarge(f"{source} holds more than {MAX_MODEL_FILES} files")
    parts = check_model_file_names(name for name, _ in siblings)
    for name, size in siblings:
        if not isinstance(size, int) or size < 0:
            raise WeightsError(f"{source}: the Hub did not say how large {name!r} is")
    files = [
        RemoteFile(name, parts[name], size, hf_hub_url(parsed.location, name, revision=sha, endpoint=hub))
        for name, size in siblings
    ]
    return files, sha


def _download_hf_file(client, parsed, remote: RemoteFile, handle, download, on_progress) -> None:
    source = f"hf:{parsed.location}@{parsed.revision}"
    with hf_errors(source), client.stream("GET", remote.location) as response:
        hf_raise_for_status(response, source)
        _write_chunks(response.iter_bytes(_CHUNK_BYTES), remote, handle, download, on_progress, source)
