"""The plugin system: in-test plugins, entry-point discovery with a faked distribution list, the allow-list,
misspelt hooks, and the core's defaults registering through the same hooks."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types
from pathlib import Path

import pluggy
import pytest

from tandem_core import hookspecs
from tandem_core.plugins import PluginError, hookimpl
from tandem_core.registry import Arch

ROOT = Path(__file__).resolve().parents[1]

TOY_ARCH = Arch("toy", ("ToyForCausalLM",), ("toy",), "toy_mod:read", "tandem-toy", "toy_mod:serve")


class ToyPlugin:
    @hookimpl
    def tandem_architectures(self, register):
        register(TOY_ARCH)

    @hookimpl
    def tandem_weight_formats(self, register):
        register("toy4", lambda w, **kw: w)

    @hookimpl
    def tandem_drafters(self, register):
        register("toy-drafter", "toy_mod:Drafter")

    @hookimpl
    def tandem_cache_tiers(self, register):
        register("toy-tier", "toy_mod:Tier")

    @hookimpl
    def tandem_cli_commands(self, register):
        register("toy", "a toy command", lambda p: None, lambda a: 0)

    @hookimpl
    def tandem_model_entries(self, register):
        register("/nonexistent/toy-registry")


def test_defaults_register_through_hooks(fresh_plugins):
    reg = fresh_plugins.registries()
    assert {"bf16", "fp16", "fp32"} <= set(reg.weight_formats)
    assert reg.owners[("weight_format", "bf16")] == "tandem_core.default_formats"
    assert {"plugins", "models", "registry", "serve", "run"} <= set(reg.cli_commands)


def test_in_test_plugin_registered_and_unregistered(fresh_plugins):
    fresh_plugins.register_plugin(ToyPlugin(), "toy")
    reg = fresh_plugins.registries()
    assert reg.architectures["toy"] is TOY_ARCH
    assert "toy4" in reg.weight_formats and reg.drafters["toy-drafter"] == "toy_mod:Drafter"
    assert reg.cache_tiers["toy-tier"] == "toy_mod:Tier"
    assert "toy" in reg.cli_commands and "/nonexistent/toy-registry" in reg.model_entries
    info = {p.name: p for p in fresh_plugins.loaded_plugins()}["toy"]
    assert info.registered["architecture"] == ["toy"] and not info.default
    fresh_plugins.unregister_plugin("toy")
    reg = fresh_plugins.registries()
    assert "toy" not in reg.architectures and "toy4" not in reg.weight_formats


def test_misspelt_hook_is_caught(fresh_plugins):
    class Typo:
        @hookimpl
        def tandem_architecture(self, register):  # no such hook: tandem_architectures
            pass

    with pytest.raises(pluggy.PluginValidationError, match="tandem_architecture"):
        fresh_plugins.register_plugin(Typo(), "typo")


def test_two_plugins_one_name_refused(fresh_plugins):
    fresh_plugins.register_plugin(ToyPlugin(), "toy")

    class Clash:
        @hookimpl
        def tandem_weight_formats(self, register):
            register("toy4", lambda w, **kw: w)

    fresh_plugins.register_plugin(Clash(), "clash")
    with pytest.raises(PluginError, match="toy4.*'toy'.*'clash'|toy4.*'clash'.*'toy'"):
        fresh_plugins.registries()


class _FakeDist:
    def __init__(self, name, version, eps):
        self.metadata = {"Name": name}
        self.version = version
        self.entry_points = eps


def _fake_module(name, fmt):
    mod = types.ModuleType(name)

    @hookimpl
    def tandem_weight_formats(register):
        register(fmt, lambda w, **kw: w)

    mod.tandem_weight_formats = tandem_weight_formats
    return mod


@pytest.fixture
def fake_dists(monkeypatch):
    mods = {"fake_alpha_plugin": _fake_module("fake_alpha_plugin", "alpha4"),
            "fake_beta_plugin": _fake_module("fake_beta_plugin", "beta4")}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    dists = [
        _FakeDist("tandem-alpha", "1.2.3", [md.EntryPoint("alpha", "fake_alpha_plugin", "tandem"),
                                             md.EntryPoint("unrelated", "os", "console_scripts")]),
        _FakeDist("tandem-beta", "0.0.1", [md.EntryPoint("beta", "fake_beta_plugin", "tandem")]),
    ]
    monkeypatch.setattr(md, "distributions", lambda: iter(dists))
    return dists


def test_entry_point_discovery(fresh_plugins, fake_dists, monkeypatch):
    monkeypatch.setenv("TANDEM_PLUGINS", "")
    reg = fresh_plugins.registries()
    assert {"alpha4", "beta4"} <= set(reg.weight_formats)
    infos = {p.name: p for p in fresh_plugins.loaded_plugins()}
    assert infos["alpha"].distribution == "tandem-alpha" and infos["alpha"].version == "1.2.3"
    assert infos["beta"].registered == {"weight_format": ["beta4"]}
    # idempotent
    fresh_plugins.load_plugins()
    assert len([n for n, _ in fresh_plugins.plugin_manager().list_name_plugin() if n == "alpha"]) == 1


def test_allow_list_restricts_and_is_read_when_called(fresh_plugins, fake_dists, monkeypatch):
    monkeypatch.setenv("TANDEM_PLUGINS", "beta")  # set after import: read at load time
    reg = fresh_plugins.registries()
    assert "beta4" in reg.weight_formats and "alpha4" not in reg.weight_formats


def test_broken_plugin_names_itself(fresh_plugins, monkeypatch):
    monkeypatch.setattr(md, "distributions", lambda: iter([
        _FakeDist("tandem-broken", "0.1", [md.EntryPoint("broken", "no_such_module_xyz", "tandem")])]))
    with pytest.raises(PluginError, match="'broken'.*no_such_module_xyz"):
        fresh_plugins.load_plugins()


def test_every_hook_is_documented_and_prefixed():
    names = [n for n in dir(hookspecs) if n.startswith("tandem")]
    doc = (ROOT / "docs" / "plugins.md").read_text()
    import inspect

    for n in names:
        fn = getattr(hookspecs, n)
        assert list(inspect.signature(fn).parameters) == ["register"], n
        assert f"`{n}(register)`" in doc, f"{n} is not documented in docs/plugins.md"


@pytest.mark.server
def test_importing_core_touches_nothing_heavy():
    import subprocess

    code = ("import sys, tandem_core, tandem_core.plugins as p; p.load_plugins(); p.registries(); "
            "import tandem_core.registry, tandem_core.catalog, tandem_core.cli.main; "
            "print(sorted(m for m in ('torch','transformers','fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
