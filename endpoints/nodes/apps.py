from django.apps import AppConfig


class NodesConfig(AppConfig):
    """GPU nodes and join tokens.

    The label stays `gpu_agent`, from when this code lived beside the agent program: tables,
    content types and migration history carry over unchanged on existing databases.
    """

    name = "endpoints.nodes"
    label = "gpu_agent"
    verbose_name = "Fleet"
    default_auto_field = "django.db.models.BigAutoField"
