"""A real `pip install` of every plugin under plugins/ into a fresh virtual environment, then `tandem plugins`.

The fresh environment sees the test environment's third-party packages (torch, ...) through a
filtered folder of links that leaves out every tandem distribution, so a plugin is listed only
because pip installed it here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # starts processes

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))


def _project(d: Path) -> dict:
    return tomllib.loads((d / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("venv")
    venv = base / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    here = Path(sysconfig.get_paths()["purelib"])
    shared = base / "shared-site"
    shared.mkdir()
    for entry in here.iterdir():
        low = entry.name.lower()
        if "tandem" in low or low.startswith("__editable__"):
            continue
        (shared / entry.name).symlink_to(entry)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "shared.pth").write_text(str(shared) + "\n")
    return py


def _pip(py: Path, *args: str) -> None:
    # pip runs from the test environment, installing into the bare venv's interpreter
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--disable-pip-version-check", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def _plugins(py: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    r = subprocess.run([str(py), "-m", "tandem_core.cli.main", "plugins"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(not PLUGIN_DIRS, reason="no plugins under plugins/")
def test_pip_install_plugins_then_tandem_plugins_lists_them(bare_venv):
    _pip(bare_venv, str(ROOT))
    before = _plugins(bare_venv)
    for d in PLUGIN_DIRS:
        assert _project(d)["name"] not in before
    for d in PLUGIN_DIRS:
        _pip(bare_venv, "-e", str(d))
    after = _plugins(bare_venv)
    for d in PLUGIN_DIRS:
        proj = _project(d)
        eps = proj["entry-points"]["tandem"]
        assert len(eps) == 1, f"{d.name}: one entry point in the group 'tandem'"
        (ep_name,) = eps
        assert f"{ep_name}  [{proj['name']} {proj['version']}]" in after, after
