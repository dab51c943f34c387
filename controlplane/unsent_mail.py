"""Mail a deployment without `EMAIL_HOST` does not send: said in the log by its recipients and subject alone.

NOTE: Django's console backend (what `make run` uses, with `DJANGO_DEBUG`) prints each message whole, and the messages
carry secrets: a password reset's link, a sign-up's verification link, an invitation's token. In production without
SMTP that put a working account takeover into every log reader's hands (and the log pipeline's). So with `DJANGO_DEBUG`
off and no `EMAIL_HOST`, a message is dropped, and only that it was is logged, at WARNING.
"""

from __future__ import annotations

import logging

from django.core.mail.backends.base import BaseEmailBackend

from controlplane.text import shown

logger = logging.getLogger("inferplane.mail")


class EmailBackend(BaseEmailBackend):
    def send_messages(self, email_messages) -> int:
        for message in email_messages:
            logger.warning(
                "mail not sent (EMAIL_HOST is not set): to %s, subject %r; its body is not logged",
                ", ".join(shown(recipient) for recipient in message.recipients()),  # an old address's escape sequence
                message.subject,
            )
        return 0
