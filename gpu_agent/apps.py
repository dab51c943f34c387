from django.apps import AppConfig


class GpuAgentConfig(AppConfig):
    """Fleet side of the GPU agent: nodes, join tokens and the agent API.

    The agent runtime (`gpu_agent.runtime`) lives in the same package but imports no Django.
    """

    name = "gpu_agent"
    verbose_name = "Fleet"
    default_auto_field = "django.db.models.BigAutoField"
