from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from django.db.models.signals import post_delete, post_save

        from billing import services
        from controlplane.accounts import keys
        from controlplane.accounts.models import Membership

        keys.api_key_created.connect(services.inherit_key_spend_cap, dispatch_uid="billing.inherit_key_spend_cap")
        post_save.connect(services.membership_changed, sender=Membership, dispatch_uid="billing.membership_saved")
        post_delete.connect(services.membership_changed, sender=Membership, dispatch_uid="billing.membership_deleted")
