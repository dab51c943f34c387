"""Migrations complete, the OpenAPI schema valid, static files hashed and compressed in production,
read-only Django admins, and CI failing on skipped tests."""

import os
import subprocess
import sys
import textwrap

import pytest
from django.conf import settings
from django.core.management import call_command

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, AuditEvent
from controlplane.accounts.services import Actor
from endpoints.nodes.models import Node
from tests.conftest import REPO_ROOT
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, sign_in_staff
from tests.test_settings import PRODUCTION_ENV


@pytest.mark.django_db
def test_every_model_change_has_its_migration():
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_the_openapi_schema_validates_without_warnings(tmp_path):
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yml"))
    assert "/api/v1/endpoints/" in (tmp_path / "schema.yml").read_text()


def test_debugging_reads_static_files_from_the_source_folders():
    # NOTE: pytest-django switches DEBUG off while tests run; the settings were read with it on.
    assert settings.WHITENOISE_USE_FINDERS
    assert settings.STORAGES["staticfiles"]["BACKEND"] == "django.contrib.staticfiles.storage.StaticFilesStorage"


def test_production_collects_hashed_and_compressed_static_files_and_does_not_search_source_folders(tmp_path):
    script = textwrap.dedent(f"""
        import django
        from django.conf import settings
        django.setup()
        settings.STATIC_ROOT = {str(tmp_path)!r}
        from django.core.management import call_command
        call_command("collectstatic", "--noinput", verbosity=0)
        print("finders", settings.WHITENOISE_USE_FINDERS)
    """)
    clean = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "TMPDIR") if name in os.environ}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env=clean | PRODUCTION_ENV | {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "finders False" in result.stdout
    css = {path.name for path in (tmp_path / "css").iterdir()}
    hashed = [name for name in css if name.startswith("app.") and name.endswith(".css") and name != "app.css"]
    assert hashed, sorted(css)
    assert f"{hashed[0]}.gz" in css
    assert (tmp_path / "staticfiles.json").exists()


@pytest.fixture
def superuser_client(client, db):
    sign_in_staff(client, UserFactory(is_staff=True, is_superuser=True))
    return client


@pytest.mark.django_db
def test_organisations_keys_audit_events_and_nodes_are_read_only_in_the_django_admin(superuser_client):
    organization = OrganizationFactory()
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role="owner")
    key = create_api_key(Actor(user=owner), organization, name="ci", scopes=["inference"]).api_key
    event = AuditEvent.objects.filter(action="api_key.create").first() or AuditEvent.objects.first()
    node = Node.objects.create(name="gpu-1", gpu_type="l4", secret_lookup="x" * 12, secret_digest="d")
    # An organisation's page saves its plan alone (quotas, `test_quotas`); nothing else of it changes here.
    page = superuser_client.get(f"/django-admin/controlplane/organization/{organization.pk}/change/").content.decode()
    assert owner.email in page and 'name="name"' not in page and 'name="slug"' not in page
    assert superuser_client.get("/django-admin/controlplane/organization/add/").status_code == 403
    superuser_client.post(f"/django-admin/controlplane/organization/{organization.pk}/change/", {"name": "renamed"})
    delete = f"/django-admin/controlplane/organization/{organization.pk}/delete/"
    assert superuser_client.post(delete, {"post": "yes"}).status_code == 403
    for path, obj in (("controlplane/apikey", key), ("controlplane/auditevent", event), ("gpu_agent/node", node)):
        assert superuser_client.get(f"/django-admin/{path}/").status_code == 200
        assert superuser_client.get(f"/django-admin/{path}/add/").status_code == 403
        page = superuser_client.get(f"/django-admin/{path}/{obj.pk}/change/")
        assert page.status_code == 200 and 'type="submit" value="Save"' not in page.content.decode()
        assert superuser_client.post(f"/django-admin/{path}/{obj.pk}/change/", {"name": "renamed"}).status_code == 403
        assert superuser_client.post(f"/django-admin/{path}/{obj.pk}/delete/", {"post": "yes"}).status_code == 403
    assert key.digest not in superuser_client.get(f"/django-admin/controlplane/apikey/{key.pk}/change/").content.decode()
    organization.refresh_from_db()
    assert organization.name != "renamed"


@pytest.mark.django_db
def test_staff_revoke_api_keys_in_the_admin_through_the_service_which_audits_it(superuser_client):
    organization = OrganizationFactory()
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role="owner")
    key = create_api_key(Actor(user=owner), organization, name="leaked", scopes=["inference"]).api_key
    response = superuser_client.post("/django-admin/controlplane/apikey/", {
        "action": "revoke", "_selected_action": [str(key.pk)],
    })
    assert response.status_code == 302
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert AuditEvent.objects.filter(action="api_key.revoke", target_id=str(key.pk)).exists()


@pytest.mark.django_db
def test_a_staff_member_who_may_only_view_api_keys_cannot_revoke_them(client):
    # The action's superuser check (`has_revoke_permission`) was never asked: Django asks only for the
    # permissions an action names.
    from django.contrib.auth.models import Permission

    organization = OrganizationFactory()
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role="owner")
    key = create_api_key(Actor(user=owner), organization, name="kept", scopes=["inference"]).api_key
    staff = UserFactory(is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_apikey"))
    sign_in_staff(client, staff)

    assert client.get("/django-admin/controlplane/apikey/").status_code == 200
    response = client.post("/django-admin/controlplane/apikey/", {"action": "revoke", "_selected_action": [str(key.pk)]})

    assert response.status_code in (200, 302)
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None


def test_under_ci_a_skipped_test_fails_the_run(tmp_path, pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("tests.ci_skips")  # the suite loads the rule (tests/conftest.py)
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        import pytest

        def test_runs():
            pass

        def test_needs_chromium():
            pytest.skip("chromium is missing")
    """))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")

    def run(ci: str, *args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in {"CI", "DJANGO_SETTINGS_MODULE"}}
        # NOTE: only the plugins the rule needs (xdist for `-n`): the installed ones' imports took ~10 s a run.
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-p", "xdist.plugin", "-p", "no:cacheprovider",
             "-q", *args, "test_sample.py"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env=env | {"PYTHONPATH": str(REPO_ROOT)} | ({"CI": ci} if ci else {}),
        )

    assert run("").returncode == 0
    in_ci = run("true")
    assert in_ci.returncode == 1
    assert "skipped under CI" in in_ci.stdout and "chromium is missing" in in_ci.stdout
    # tests/run.sh runs the suite on xdist workers: the verdict made on a worker reaches the run's result.
    on_a_worker = run("true", "-n", "1")
    assert on_a_worker.returncode == 1
    assert "skipped under CI" in on_a_worker.stdout and "chromium is missing" in on_a_worker.stdout
