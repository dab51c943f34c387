"""A transactional test's reset (tests/database_reset.py) leaves what Django's flush leaves: every table empty but
the content types and permissions post_migrate makes, all of them, also after a test changed them."""

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.test import TransactionTestCase

from controlplane.accounts.models import Membership, Organization
from tests import database_reset
from tests.factories import MembershipFactory, OrganizationFactory


def _made_by_post_migrate() -> tuple[set, set]:
    return (
        set(ContentType.objects.values_list("app_label", "model")),
        set(Permission.objects.values_list("content_type__app_label", "codename")),
    )


@pytest.mark.django_db(transaction=True)
def test_a_reset_empties_the_tables_and_keeps_or_makes_again_every_content_type_and_permission():
    reset = TransactionTestCase()
    reset._fixture_teardown()  # Django's flush the first time: what post_migrate makes is known from then on
    made = _made_by_post_migrate()
    assert made[0] and made[1]

    OrganizationFactory()
    reset._fixture_teardown()  # the kept tables as post_migrate made them: left in place
    assert Organization.objects.count() == 0 and _made_by_post_migrate() == made

    OrganizationFactory()
    Permission.objects.filter(codename="view_organization").delete()
    ContentType.objects.filter(model="organization").update(model="renamed")
    reset._fixture_teardown()  # changed: Django's flush, post_migrate and all

    assert Organization.objects.count() == 0 and _made_by_post_migrate() == made
    assert database_reset.POST_MIGRATE_TABLES == (
        ContentType._meta.db_table,
        Permission._meta.db_table,
    )


@pytest.mark.django_db(transaction=True)
def test_the_content_types_cache_is_cleared_when_their_rows_are_kept():
    TransactionTestCase()._fixture_teardown()  # the rows' fingerprint is known from here on
    content_type = ContentType.objects.get_for_model(Organization)
    ContentType.objects.filter(pk=content_type.pk).update(model="renamed")
    ContentType.objects.clear_cache()
    assert ContentType.objects.get_for_id(content_type.pk).model == "renamed"  # cached by id
    ContentType.objects.filter(pk=content_type.pk).update(model="organization")  # the rows as post_migrate made them

    TransactionTestCase()._fixture_teardown()

    assert ContentType.objects.get_for_id(content_type.pk).model == "organization"


@pytest.mark.django_db(transaction=True)
def test_a_reset_empties_every_table_that_holds_a_row_and_those_referencing_it():
    from django.db import connection

    TransactionTestCase()._fixture_teardown()  # the rows' fingerprint is known from here on
    MembershipFactory()  # a user and an organisation, and a row referencing both
    assert set(database_reset._tables_with_rows(connection)) >= {Membership._meta.db_table, Organization._meta.db_table}

    TransactionTestCase()._fixture_teardown()

    assert database_reset._tables_with_rows(connection) == []
    assert _made_by_post_migrate()[0]


def _file_of(connection, table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_relation_filenode(%s)", [table])
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_reset_deletes_the_rows_and_gives_no_table_new_files():
    # TRUNCATE gave every table that held a row (and each one referencing it) new files: ~0.1 s a test, ~0.3 s on a
    # loaded machine, for ~1,500 transactional tests. Deleting a test's few rows takes milliseconds.
    from django.db import connection

    TransactionTestCase()._fixture_teardown()  # the rows' fingerprint is known from here on
    MembershipFactory()
    files = {table: _file_of(connection, table) for table in (Membership._meta.db_table, Organization._meta.db_table)}

    TransactionTestCase()._fixture_teardown()

    assert database_reset._tables_with_rows(connection) == []
    assert {table: _file_of(connection, table) for table in files} == files


@pytest.mark.django_db(transaction=True)
def test_a_row_outside_djangos_tables_referencing_one_emptied_is_emptied_with_it():
    # A key Django did not make (not deferred) refuses the delete: the reset empties the tables as flush does.
    from django.db import connection

    TransactionTestCase()._fixture_teardown()
    organization = OrganizationFactory()
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE outside_reference (organization_id bigint REFERENCES {Organization._meta.db_table} (id))"
        )
        cursor.execute("INSERT INTO outside_reference VALUES (%s)", [organization.pk])
    try:
        TransactionTestCase()._fixture_teardown()

        assert database_reset._tables_with_rows(connection) == []
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM outside_reference")
            assert cursor.fetchone()[0] == 0
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE outside_reference")
