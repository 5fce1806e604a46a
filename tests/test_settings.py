"""The settings registry is the only reader of the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem_core.settings import SETTINGS, EngineSettings, Setting, SettingError, SettingsRegistry

ROOT = Path(__file__).resolve().parents[1]
ENV_READ = re.compile(r"os\.environ|os\.getenv|from os import (environ|getenv)|environ\.get\(")


def test_no_environment_read_outside_the_registry():
    offenders = []
    files = list((ROOT / "tandem_core").rglob("*.py")) + list((ROOT / "plugins").rglob("*.py"))
    for path in files:
        if path == ROOT / "tandem_core" / "settings.py" or "/tests/" in str(path) or "/build/" in str(path):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if ENV_READ.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "environment read outside tandem_core/settings.py:\n" + "\n".join(offenders)


def test_get_default_and_parse(monkeypatch):
    monkeypatch.delenv("TANDEM_THREADS", raising=False)
    assert SETTINGS.get("THREADS") == 0
    monkeypatch.setenv("TANDEM_THREADS", "3")
    assert SETTINGS.get("TANDEM_THREADS") == 3
    monkeypatch.setenv("TANDEM_THREADS", "three")
    with pytest.raises(SettingError, match="THREADS"):
        SETTINGS.get("THREADS")


def test_unknown_setting_names_it():
    with pytest.raises(SettingError, match="TANDEM_NO_SUCH_SWITCH"):
        SETTINGS.get("NO_SUCH_SWITCH")


def test_engine_settings_over_another_mapping_and_prefix():
    s = EngineSettings({"X_THREADS": "7", "TANDEM_THREADS": "2"}, prefix="X_")
    assert s.get("THREADS") == 7
    assert EngineSettings({}, prefix="X_").get("THREADS") == 0


def test_every_setting_has_owner_and_meaning():
    for s in SETTINGS:
        assert s.owner and s.meaning and s.name.upper() == s.name, s


def test_declare_twice_differently_refused():
    reg = SettingsRegistry()
    reg.declare(Setting("A", 1, "m", "x", int))
    reg.declare(Setting("A", 1, "m", "x", int))  # identical: fine
    with pytest.raises(SettingError, match="declared twice"):
        reg.declare(Setting("A", 2, "other", "x", int))


def test_bool_parsing(monkeypatch):
    monkeypatch.setenv("TANDEM_DISABLE_ENTRYPOINTS", "yes")
    assert SETTINGS.get("DISABLE_ENTRYPOINTS") is True
    monkeypatch.setenv("TANDEM_DISABLE_ENTRYPOINTS", "maybe")
    with pytest.raises(SettingError):
        SETTINGS.get("DISABLE_ENTRYPOINTS")
