from django.apps import AppConfig


class ControlPlaneConfig(AppConfig):
    name = "controlplane"
    verbose_name = "Accounts and organisations"
    default_auto_field = "django.db.models.BigAutoField"
