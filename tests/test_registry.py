"""The architecture registry and the model registry (model.yaml, schema 1)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem_core import catalog
from tandem_core.plugins import hookimpl
from tandem_core.registry import Arch, UnknownArchitecture, architecture

ROOT = Path(__file__).resolve().parents[1]


class TwoArchs:
    @hookimpl
    def tandem_architectures(self, register):
        register(Arch("alpha", ("AlphaForCausalLM",), ("alpha",), "m:c", "tandem-alpha", "m:s"))
        register(Arch("beta", ("BetaForConditionalGeneration",), ("beta", "beta_text"), "m:c", "tandem-beta", "m:s"))


def test_architecture_by_name_and_by_model_type(fresh_plugins):
    fresh_plugins.register_plugin(TwoArchs(), "two")
    assert architecture({"architectures": ["AlphaForCausalLM"]}).name == "alpha"
    assert architecture({"model_type": "x", "text_config": {"model_type": "beta_text"}}).name == "beta"


def test_unknown_architecture_names_it_and_every_registered(fresh_plugins):
    fresh_plugins.register_plugin(TwoArchs(), "two")
    with pytest.raises(UnknownArchitecture) as ei:
        architecture({"architectures": ["GammaForCausalLM"], "model_type": "gamma"})
    msg = str(ei.value)
    assert "GammaForCausalLM" in msg and "gamma" in msg
    assert "AlphaForCausalLM" in msg and "BetaForConditionalGeneration" in msg


def _run(*args):
    return subprocess.run([sys.executable, "-m", "tandem_core.cli.main", *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_registry_check_passes_shipped_files():
    r = _run("registry", "--check")
    assert r.returncode == 0, r.stderr
    assert "all sound" in r.stdout


def test_registry_schema_prints_json():
    import json

    r = _run("registry", "--schema")
    assert r.returncode == 0 and json.loads(r.stdout)["properties"]["schema"]["const"] == 1


def _broken_copy(tmp_path: Path, edit) -> Path:
    src = ROOT / "tandem_core" / "shipped" / "models" / "qwen3.8-27b" / "model.yaml"
    d = tmp_path / "reg" / "models" / "qwen3.8-27b"
    d.mkdir(parents=True)
    data = yaml.safe_load(src.read_text())
    edit(data)
    (d / "model.yaml").write_text(yaml.safe_dump(data))
    return tmp_path / "reg"


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["profiles"][1].update(recommended=True), "exactly one profile must be recommended"),
    (lambda d: d["profiles"][0].update(weights_gib=40.0), "profile 'bf16'"),
    (lambda d: d["memory"].update(kv_bytes_per_token=1234), "kv_bytes_per_token"),
    (lambda d: d.update(tools=[{"name": "drafter", "needs_profile": "nvfp4"}]), "needs profile 'nvfp4'"),
    (lambda d: d.update(tools=[{"name": "drafter", "settings": ["NOT_A_SWITCH"]}]), "NOT_A_SWITCH"),
    (lambda d: d.update(docs="docs/not-there.md"), "docs link"),
    (lambda d: d["sources"].pop("context"), "number 'context' has no source"),
    (lambda d: d.update(colour="blue"), "colour"),
    (lambda d: d.update(id="other"), "not named after id"),
])
def test_registry_check_refuses_broken(tmp_path, edit, needle):
    reg = _broken_copy(tmp_path, edit)
    r = _run("registry", "--check", "--dir", str(reg))
    assert r.returncode == 1
    assert needle in r.stderr, r.stderr


def test_resolve_missing_model_says_where_and_what(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TANDEM_HF_CACHE", str(tmp_path / "hf"))
    with pytest.raises(catalog.ModelNotFound) as ei:
        catalog.resolve("qwen3.8-27b")
    msg = str(ei.value)
    assert str(tmp_path / "home" / "models" / "qwen3.8-27b") in msg and "Qwen/Qwen3.8-27B" in msg


def test_resolve_hf_cache_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TANDEM_HF_CACHE", str(tmp_path / "hf"))
    base = tmp_path / "hf" / "models--Qwen--Qwen3.8-27B"
    snap = base / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("abc123")
    assert catalog.resolve("qwen3.8-27b") == ("qwen3.8-27b", snap)
    assert catalog.resolve("qwen3.8-27b", weights=str(snap))[1] == snap


def test_serve_missing_model_is_a_message_not_a_traceback(tmp_path):
    env = {"TANDEM_HOME": str(tmp_path / "home"), "TANDEM_HF_CACHE": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "run", "--model", "qwen3.8-27b",
                        "--prompt", "hi"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 1  # a model that is not there is a load error (usage errors are 2)
    assert "Traceback" not in r.stderr and "not on this machine" in r.stderr and "tandem pull" in r.stderr
