"""The web process's access log (`controlplane.access_log`): with uvicorn's access line off, every request
that reaches the pod and is not an inference call (which has its own request line) still leaves one line."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from asgiref.testing import ApplicationCommunicator

from controlplane.access_log import AccessLog
from controlplane.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]] = (), query: bytes = b"") -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
            "headers": [(b"host", b"testserver"), *headers], "client": ("10.1.2.3", 40000), "server": ("testserver", 80)}


async def _answer(app, scope: dict, body: bytes = b"") -> int:
    communicator = ApplicationCommunicator(app, scope)
    await communicator.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await communicator.receive_output(30)
    while (await communicator.receive_output(30)).get("more_body"):
        pass
    await communicator.wait(30)
    return start["status"]


def _lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "inferplane.access"]


def test_a_console_or_api_request_leaves_one_line_with_its_status_and_no_query_string(caplog):
    caplog.set_level(logging.INFO, logger="inferplane.access")
    status = asyncio.run(_answer(application, _scope("GET", "/api/v1/endpoints/", query=b"token=secret-in-a-query")))
    assert status == 401
    (line,) = _lines(caplog)
    assert line.startswith('10.1.2.3:40000 "GET /api/v1/endpoints/" 401 ') and "secret" not in line


def test_a_refused_inference_call_leaves_a_line_with_its_request_id(caplog):
    caplog.set_level(logging.INFO, logger="inferplane.access")
    status = asyncio.run(_answer(application, _scope("POST", "/v1/chat/completions",
                                                     [(b"authorization", b"Bearer sk-not-a-key"),
                                                      (b"content-type", b"application/json")]),
                                 b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'))
    assert status == 401
    (line,) = _lines(caplog)
    assert '"POST /v1/chat/completions" 401 ' in line and " request_id=" in line and "sk-not-a-key" not in line


def test_an_app_that_fails_before_answering_is_logged_with_status_0(caplog):
    caplog.set_level(logging.INFO, logger="inferplane.access")

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        asyncio.run(AccessLog(broken)(_scope("GET", "/x"), None, None))
    (line,) = _lines(caplog)
    assert re.fullmatch(r'10\.1\.2\.3:40000 "GET /x" 0 \d+\.\dms', line)


@pytest.mark.parametrize("path, logged", [
    ("/reset/MQ/c5xyz7-0a1b2c3d4e5f60718293a4b5c6d7e8f9/", "/reset/MQ/<token>/"),
    ("/verify-email/Mg:1tSx0q:s3cr3t-signature-value/", "/verify-email/<token>/"),
    ("/invitations/inv_4Fh8sEcReTvAlUe_9/", "/invitations/<token>/"),
])
def test_a_token_in_the_path_is_never_logged(caplog, path, logged):
    """Before, the path was logged as it came: a password reset's, an email verification's or an invitation's link,
    each of which signs its bearer in or into an organisation, was in the access log."""
    caplog.set_level(logging.INFO, logger="inferplane.access")
    asyncio.run(_answer(application, _scope("GET", path)))
    (line,) = _lines(caplog)
    token = path.rstrip("/").rsplit("/", 1)[1]
    assert f'"GET {logged}" ' in line and token not in line


@pytest.mark.parametrize("path, token, logged", [
    ("/reset/MQ/c5xyz7-0a1b2c3d4e5f60718293a4b5c6d7e8f9", "c5xyz7-0a1b2c3d4e5f60718293a4b5c6d7e8f9", "/reset/<redacted>"),
    ("/invitations/inv_4Fh8sEcReTvAlUe_9/more", "inv_4Fh8sEcReTvAlUe_9", "/invitations/<redacted>"),
])
def test_a_token_in_a_link_that_resolves_to_nothing_is_never_logged(caplog, path, token, logged):
    """Before, a link cut short or lengthened (a mail client drops the last slash) matched no route and was logged whole,
    its token with it."""
    caplog.set_level(logging.INFO, logger="inferplane.access")
    asyncio.run(_answer(application, _scope("GET", path)))
    (line,) = _lines(caplog)
    assert f'"GET {logged}" ' in line and token not in line


def test_paths_without_a_token_are_logged_as_they_came(caplog):
    caplog.set_level(logging.INFO, logger="inferplane.access")
    asyncio.run(_answer(application, _scope("GET", "/verify-email/resend/")))
    asyncio.run(_answer(application, _scope("GET", "/invitations/")))
    assert [line.split('"')[1] for line in _lines(caplog)] == ["GET /verify-email/resend/", "GET /invitations/"]


def test_a_path_s_decoded_line_break_is_written_escaped_so_a_line_forges_no_other(caplog):
    """The ASGI path is decoded (`%0a` is a line break): written as it came, with the plain formatter, it wrote whole
    forged access lines (another client's call, a 200)."""
    caplog.set_level(logging.INFO, logger="inferplane.access")
    forged = '/x\n2026-12-06 21:00:00,000 INFO inferplane.access 10.0.0.9:4242 "POST /v1/chat/completions" 200 3.0ms'

    asyncio.run(_answer(application, _scope("GET", forged + "\r\x00")))

    (line,) = _lines(caplog)
    assert line.rsplit('" ', 1)[0] == '10.1.2.3:40000 "GET ' + forged.replace("\n", "\\n") + "\\r\\x00"
    assert line.isprintable()


def test_a_files_api_answer_leaves_a_line_with_the_request_id_its_answer_names(caplog, org, member_client_factory):
    """The gateway names each Files and Batch API answer it hands to Django (`x-request-id`): its access line names the
    same id, so the one a support ticket quotes is found in the log (before: the header only, no id in any line)."""
    key = member_client_factory(org).plain_key
    caplog.set_level(logging.INFO, logger="inferplane.access")

    async def answer() -> dict:
        communicator = ApplicationCommunicator(application, _scope("GET", "/v1/files/file-nope",
                                                                   [(b"authorization", f"Bearer {key}".encode())]))
        await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
        start = await communicator.receive_output(30)
        while (await communicator.receive_output(30)).get("more_body"):
            pass
        await communicator.wait(30)
        return start

    start = asyncio.run(answer())
    assert start["status"] == 404
    (request_id,) = [value.decode() for name, value in start["headers"] if name == b"x-request-id"]
    (line,) = _lines(caplog)
    assert '"GET /v1/files/file-nope" 404 ' in line and line.endswith(f" request_id={request_id}")
