"""Mail in a deployment without SMTP (`controlplane.unsent_mail`): never its secrets in the log."""

import logging

from django.core import mail
from django.core.mail import EmailMessage

from controlplane.log_privacy import address_digest
from tests.test_settings import _read_setting, forks  # noqa: F401 - the fixture `_read_setting` forks from


def test_a_production_without_email_host_drops_mail_and_logs_only_whom_it_was_for(forks):  # noqa: F811
    # Before: Django's console backend, which prints the whole message (a password reset's link) to the log.
    chosen = _read_setting(forks, {"EMAIL_HOST": ""}, "settings.EMAIL_BACKEND")
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.strip().splitlines()[-1] == "'controlplane.unsent_mail.EmailBackend'"
    with_smtp = _read_setting(forks, {"EMAIL_HOST": "smtp.example.com"}, "settings.EMAIL_BACKEND")
    assert with_smtp.stdout.strip().splitlines()[-1] == "'django.core.mail.backends.smtp.EmailBackend'"


def test_the_unsent_mail_backend_says_who_was_not_mailed_by_digest_and_nothing_of_the_subject_or_body(caplog):
    """Before, the line named the recipient's address and the subject (an organisation's name, often its owner's): a
    deleted account's address outlived it in the log (`controlplane.log_privacy`)."""
    connection = mail.get_connection("controlplane.unsent_mail.EmailBackend")
    message = EmailMessage(
        "Reset your password", "https://console.example.com/reset/MQ/secret-token-123/", to=["ada@example.com"]
    )
    with caplog.at_level(logging.WARNING, logger="inferplane.mail"):
        assert connection.send_messages([message]) == 0
    assert f"to <address {address_digest('ada@example.com')}>" in caplog.text
    assert "ada@example.com" not in caplog.text
    assert "Reset your password" not in caplog.text
    assert "secret-token-123" not in caplog.text


def test_an_address_from_before_control_characters_were_refused_reaches_the_log_as_its_digest_alone(caplog):
    """An escape sequence in an address (`normalize_email` refuses one now; older accounts and invitations may hold
    one) was written raw to the log: the operator's terminal ran it."""
    connection = mail.get_connection("controlplane.unsent_mail.EmailBackend")
    message = EmailMessage("Verify your email", "…", to=['"a\x1b]0;pwned\x07"@example.com'])
    with caplog.at_level(logging.WARNING, logger="inferplane.mail"):
        assert connection.send_messages([message]) == 0
    assert "\x1b" not in caplog.text and "\x07" not in caplog.text
    assert f"to <address {address_digest(message.to[0])}>" in caplog.text
