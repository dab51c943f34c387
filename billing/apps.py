from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from billing import services
        from controlplane.accounts import keys

        keys.api_key_created.connect(services.inherit_key_spend_cap, dispatch_uid="billing.inherit_key_spend_cap")
