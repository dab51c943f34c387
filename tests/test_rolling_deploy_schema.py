"""A rolling deploy runs the new migrations first, while pods, workers and agents' API handlers of the code before
them still write rows with the columns they know (README, *A rolling deploy*). A NOT NULL column that a migration adds
to a table must therefore have a database default: without one, the old code's INSERT is refused (a 500 for a Stripe
webhook, a node's registration, a sign-up's verification; a crashed task for a replica's placement)."""

import pytest
from django.apps import apps
from django.core.exceptions import FieldDoesNotExist
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations import AddField
from django.db.models import NOT_PROVIDED

from billing.models import DeletedStripeCustomer, Invoice
from controlplane.accounts.models import EmailVerification
from endpoints.models import ModelFacts, Replica
from endpoints.nodes.models import Node
from tests.factories import EndpointFactory, OrganizationFactory, UserFactory

# The platform's own packages; a third-party app's migrations are its own.
OWN_PACKAGES = ("billing.", "controlplane.", "endpoints.")
# NOTE: columns a migration added without a database default, on purpose: no one value is right for a row that code
# from before it writes. A rolling deploy from a version older than these migrations is not supported.
WITHOUT_A_DATABASE_DEFAULT = {
    ("billing", "usagerecord", "billing_mode"): "the organisation's billing mode at the call, not a constant",
    ("billing", "usagerollup", "billing_mode"): "the organisation's billing mode at the call, not a constant",
    ("endpoints", "replica", "encrypted_engine_key"): "a random secret of each replica's own",
    ("gpu_agent", "node", "advertise_host"): "the node's own address",
    ("gpu_agent", "node", "engine_port_min"): "the node's own engine ports",
    ("gpu_agent", "node", "engine_port_max"): "the node's own engine ports",
}


def _added_not_null_fields():
    """(app label, model, field) of each NOT NULL column a migration of ours added to a table it did not create."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    for (app_label, _), migration in sorted(loader.disk_migrations.items()):
        if not type(migration).__module__.startswith(OWN_PACKAGES):
            continue
        for operation in migration.operations:
            if not isinstance(operation, AddField):
                continue
            try:
                field = apps.get_model(app_label, operation.model_name)._meta.get_field(operation.name)
            except (LookupError, FieldDoesNotExist):  # removed since
                continue
            if not field.null and not field.many_to_many:
                yield app_label, operation.model_name, operation.name, field


@pytest.mark.django_db
def test_every_not_null_column_a_migration_added_has_a_database_default():
    # Before: 35 columns had none (billing/0024's `billed_periods`, billing/0020's invoice customer, accounts/0011's
    # `confirmed_by_owner`, nodes/0006's `engine_sandbox`, endpoints/0021's `engine_generation`, ...).
    missing = []
    for app_label, model_name, field_name, field in _added_not_null_fields():
        if (app_label, model_name, field_name) in WITHOUT_A_DATABASE_DEFAULT:
            continue
        with connection.cursor() as cursor:
            cursor.execute("SELECT column_default FROM information_schema.columns"
                           " WHERE table_schema = current_schema() AND table_name = %s AND column_name = %s",
                           [field.model._meta.db_table, field.column])
            (column_default,) = cursor.fetchone()
        if field.db_default is NOT_PROVIDED or column_default is None:
            missing.append(f"{app_label}.{model_name}.{field_name}")
    assert missing == []


def _insert_as_older_code(instance, *, without: str):
    """INSERT `instance` as code from before the column `without` existed writes it: every other concrete column."""
    model = type(instance)
    fields = [field for field in model._meta.local_concrete_fields
              if field.name != without and field is not model._meta.auto_field]
    for field in fields:
        field.pre_save(instance, add=True)
    [(pk,)] = model._base_manager._insert([instance], fields=fields, returning_fields=[model._meta.pk])
    return model._base_manager.get(pk=pk)


def _node():
    return Node.objects.create(name="old-pod-node")


def _verification():
    user = UserFactory()
    EmailVerification.objects.filter(user=user).delete()  # the factory's user is verified already
    return EmailVerification(user=user, email=user.email)


OLD_WRITES = {
    # A Stripe webhook (`customer.deleted`) handled by a web pod before billing/0024.
    "deleted_customer": (lambda: DeletedStripeCustomer(stripe_customer_id="cus_old", organization=OrganizationFactory()),
                         "billed_periods", []),
    # An invoice's webhook handled by a web pod before billing/0020.
    "invoice": (lambda: Invoice(organization=OrganizationFactory(), stripe_invoice_id="in_old", status="open"),
                "stripe_customer_id", ""),
    # A sign-up's verification link followed on a web pod before accounts/0011: signed out was still accepted.
    "email_verification": (_verification, "confirmed_by_owner", False),
    # A node registering through a web pod before nodes/0006.
    "node_sandbox": (lambda: Node(name="gpu-old"), "engine_sandbox", ""),
    # A node's heartbeat while a web pod before nodes/0005 marks it.
    "node_state_before_offline": (lambda: Node(name="gpu-old"), "state_before_offline", ""),
    # An endpoint created through a web pod before endpoints/0021, a replica placed by a worker before it.
    "endpoint": (lambda: EndpointFactory.build(organization=OrganizationFactory()), "engine_generation", 0),
    "replica": (lambda: Replica(endpoint=EndpointFactory(), node=_node()), "engine_generation", 0),
    # Model facts an agent's heartbeat taught a web pod before endpoints/0022.
    "model_facts": (lambda: ModelFacts(source="hf:org/old"), "disputed", {}),
}


@pytest.mark.django_db
@pytest.mark.parametrize("case", sorted(OLD_WRITES))
def test_a_row_written_by_code_before_a_column_gets_what_the_migration_gave_the_rows_before_it(case):
    # Before: a NotNullViolation for each (the old code's INSERT refused: a 500, or a task that failed).
    make, field_name, expected = OLD_WRITES[case]
    row = _insert_as_older_code(make(), without=field_name)
    assert getattr(row, field_name) == expected



def test_every_migration_of_ours_can_be_reversed():
    """A rollback that reverses migrations runs `migrate <app> <the previous release's last migration>` from the newer
    image (README, *A rolling deploy*): an irreversible operation (a RunPython or RunSQL without its reverse) would
    stop it there (guard: passes before and after)."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    irreversible = []
    for key, migration in sorted(loader.disk_migrations.items()):
        if not type(migration).__module__.startswith(OWN_PACKAGES):
            continue
        operations = list(migration.operations)
        while operations:
            operation = operations.pop()
            operations.extend(getattr(operation, "database_operations", ()))
            if not operation.reversible:
                irreversible.append(f"{key[0]}.{key[1]}: {operation.describe()}")
    assert irreversible == []
