from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "endpoints"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from controlplane.accounts import departures, services
        from endpoints import closing, quotas

        # NOTE: the Django admin's user delete (accounts) reaches the account-deletion rule through this registry:
        # accounts may not import endpoints (the layers in pyproject.toml)
        departures.register_account_deletion(departures.AccountDeletion(refusals=closing.account_refusals,
                                                                        end=closing.end_account))
        services.register_drains_of(quotas.drains_of)
        services.replica_quotas_changed.connect(quotas.reconcile_organizations,
                                                dispatch_uid="endpoints.reconcile_organizations")
