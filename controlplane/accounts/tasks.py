"""The accounts app's tasks: mail a web request asks for and never waits on."""

from celery import shared_task

from controlplane.accounts.signup import mail_password_reset


@shared_task(name="accounts.mail_password_reset", acks_late=True, time_limit=60, soft_time_limit=45)
def send_password_reset_mail(email: str, domain: str, use_https: bool) -> None:
    """The password reset form's mail for `email`, sent off its request (`signup.mail_password_reset`)."""
    mail_password_reset(email, domain=domain, use_https=use_https)
