"""Mail a deployment without `EMAIL_HOST` does not send: said in the log by its recipients and subject alone.

NOTE: Django's console backend (what `make run` uses, with `DJANGO_DEBUG`) prints each message whole, and the messages
carry secrets: a password reset's link, a sign-up's verification link, an invitation's token. In production without
SMTP that put a working account takeover into every log reader's hands (and the log pipeline's). So with `DJANGO_DEBUG`
off and no `EMAIL_HOST`, a message is dropped, and only that it was is logged, at WARNING: its recipients by their keyed
digest (`log_privacy.address_digest`), never their address, and not its subject, which names an organisation (often its
owner's own name). Logs outlive an account's erasure.
"""

from __future__ import annotations

import logging

from django.core.mail.backends.base import BaseEmailBackend

from controlplane.log_privacy import shown_address

logger = logging.getLogger("inferplane.mail")


class EmailBackend(BaseEmailBackend):
    def send_messages(self, email_messages) -> int:
        for message in email_messages:
            logger.warning(
                "mail not sent (EMAIL_HOST is not set): to %s; its subject and body are not logged",
                ", ".join(shown_address(recipient) for recipient in message.recipients()),
            )
        return 0
