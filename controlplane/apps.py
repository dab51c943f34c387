from django.apps import AppConfig


class ProjectConfig(AppConfig):
    """The project's wiring (settings, URLs, ASGI, Celery, embedded servers, the demo) as an app
    only for what Django finds by app: the `run_local` and `rotate_encryption_keys` commands, the
    console's template tags, the worker's liveness task and the project's system checks
    (`controlplane.checks`). It has no models."""

    name = "controlplane"
    label = "inferplane"
    verbose_name = "Inferplane"

    def ready(self) -> None:
        from controlplane import checks  # noqa: F401 - registers the project's system checks
