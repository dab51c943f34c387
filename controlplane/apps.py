from django.apps import AppConfig


class ProjectConfig(AppConfig):
    """The project's wiring (settings, URLs, ASGI, Celery, embedded servers, the demo) as an app
    only for what Django finds by app: the `run_local` and `rotate_encryption_keys` commands, the
    console's template tags and the worker's liveness task. It has no models."""

    name = "controlplane"
    label = "inferplane"
    verbose_name = "Inferplane"
