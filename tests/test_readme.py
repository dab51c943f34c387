"""The README's configuration table names every environment variable the settings read."""

import re

from controlplane.env import SETTINGS_ENV_VARS
from tests.conftest import REPO_ROOT


def test_readme_opens_with_the_two_commands():
    text = (REPO_ROOT / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make run" in first_block and "make test" in first_block


def test_every_setting_is_in_the_configuration_table(settings):
    table = (REPO_ROOT / "README.md").read_text().split("## Configuration", 1)[1]
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    assert SETTINGS_ENV_VARS, "settings read no environment variables?"
    missing = sorted(SETTINGS_ENV_VARS - documented)
    assert not missing, f"undocumented settings: {missing}"
