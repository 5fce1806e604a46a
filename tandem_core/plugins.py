"""Plugin discovery and the registries the hooks fill.

Discovery is explicit, lazy and idempotent: nothing happens at import;
``load_plugins()`` registers the core's default plugins, then every entry point
in the group ``tandem`` (restricted by the ``TANDEM_PLUGINS`` allow-list, read
when called), then checks for misspelt hooks. ``registries()`` calls each hook
implementation with a ``register`` callback and remembers which plugin
registered what, so ``tandem plugins`` can say it.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from tandem_core import hookspecs
from tandem_core.settings import SETTINGS, Setting

__all__ = [
    "hookimpl", "DEFAULT_PLUGINS", "PluginInfo", "Registries", "load_plugins", "plugin_manager",
    "registries", "register_plugin", "unregister_plugin", "loaded_plugins", "import_string",
]

hookimpl = pluggy.HookimplMarker("tandem")

# The core's own defaults ship through the same hooks.
DEFAULT_PLUGINS = (
    "tandem_core.default_formats",
    "tandem_core.default_commands",
    "tandem_core.default_entries",
    "tandem_core.default_caches",
    "tandem_core.default_tool_formats",
    "tandem_core.server.default_settings",
)

HOOKS = (
    "tandem_architectures", "tandem_weight_formats", "tandem_drafters", "tandem_tool_formats",
    "tandem_cache_tiers", "tandem_cli_commands", "tandem_settings", "tandem_model_entries",
)


class PluginError(RuntimeError):
    """A plugin failed to import, or two plugins registered the same name."""


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    default: bool
    registered: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class Registries:
    """What the hooks registered, by kind. Values are factories or import paths, never live engines."""

    architectures: dict[str, Any] = field(default_factory=dict)
    weight_formats: dict[str, Callable[..., Any]] = field(default_factory=dict)
    drafters: dict[str, str] = field(default_factory=dict)
    tool_formats: dict[str, str] = field(default_factory=dict)
    cache_tiers: dict[str, str] = field(default_factory=dict)
    cli_commands: dict[str, tuple] = field(default_factory=dict)
    model_entries: list[str] = field(default_factory=list)
    owners: dict[tuple[str, str], str] = field(default_factory=dict)


class _Host:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("tandem")
        self.pm.add_hookspecs(hookspecs)
        self.loaded = False
        self.dists: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self.defaults: set[str] = set()
        self._reg: Registries | None = None
        self.lock = threading.RLock()

    def invalidate(self) -> None:
        self._reg = None


_host = _Host()


def plugin_manager() -> pluggy.PluginManager:
    return _host.pm


def _allow_list() -> set[str] | None:
    raw = SETTINGS.get("PLUGINS")
    names = {n.strip() for n in str(raw).split(",") if n.strip()}
    return names or None


def _entry_points() -> Iterable[tuple[md.EntryPoint, md.Distribution | None]]:
    for dist in md.distributions():
        for ep in dist.entry_points:
            if ep.group == "tandem":
                yield ep, dist


def load_plugins() -> pluggy.PluginManager:
    """Register the default plugins and the installed ones, once. Safe to call again."""
    with _host.lock:
        if _host.loaded:
            return _host.pm
        _host.loaded = True
        for modname in DEFAULT_PLUGINS:
            mod = importlib.import_module(modname)
            if not _host.pm.is_registered(mod):
                _host.pm.register(mod, name=modname)
            _host.defaults.add(modname)
        if not SETTINGS.get("DISABLE_ENTRYPOINTS"):
            allow = _allow_list()
            seen: set[str] = set()
            for ep, dist in _entry_points():
                if ep.name in seen or (allow is not None and ep.name not in allow):
                    continue
                seen.add(ep.name)
                if _host.pm.get_plugin(ep.name) is not None:
                    continue
                try:
                    mod = ep.load()
                except Exception as exc:  # a broken plugin names itself
                    raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {exc}") from exc
                _host.pm.register(mod, name=ep.name)
                if dist is not None:
                    _host.dists[ep.name] = (dist.metadata["Name"], dist.version)
        for modname in (m.strip() for m in str(SETTINGS.get("EXTRA_PLUGINS")).split(",")):
            if modname and _host.pm.get_plugin(modname) is None:
                try:
                    mod = importlib.import_module(modname)
                except ImportError as exc:
                    raise PluginError(f"extra plugin {modname!r} (TANDEM_EXTRA_PLUGINS) failed to import: {exc}") from exc
                _host.pm.register(mod, name=modname)
        _host.pm.check_pending()
        _declare_settings()
        _host.invalidate()
        return _host.pm


def _declare_settings() -> None:
    for impl in _host.pm.hook.tandem_settings.get_hookimpls():
        impl.function(register=SETTINGS.declare)


def register_plugin(obj: Any, name: str) -> None:
    """Register a plugin object (a module or an instance with hookimpls) at run time."""
    load_plugins()
    with _host.lock:
        _host.pm.register(obj, name=name)
        _host.pm.check_pending()
        for impl in _host.pm.hook.tandem_settings.get_hookimpls():
            if impl.plugin_name == name:
                impl.function(register=SETTINGS.declare)
        _host.invalidate()


def unregister_plugin(name: str) -> None:
    with _host.lock:
        _host.pm.unregister(name=name)
        _host.invalidate()


def _collect() -> Registries:
    reg = Registries()
    pm = _host.pm

    def each(hook: str) -> Iterable[tuple[str, Callable[..., None]]]:
        # reversed: pluggy lists last-registered first; defaults register first and are overridden by nobody
        for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):
            yield impl.plugin_name, impl.function

    def keyed(hook: str, kind: str, target: dict[str, Any]) -> None:
        for owner, fn in each(hook):
            def register(name: str, value: Any = None, *rest: Any, _owner: str = owner) -> None:
                if name in target and reg.owners.get((kind, name)) != _owner:
                    raise PluginError(f"{kind} {name!r} registered by both "
                                      f"{reg.owners[(kind, name)]!r} and {_owner!r}")
                target[name] = (value, *rest) if rest else value
                reg.owners[(kind, name)] = _owner
            fn(register=register)

    for owner, fn in each("tandem_architectures"):
        def register_arch(arch: Any, _owner: str = owner) -> None:
            if arch.name in reg.architectures:
                raise PluginError(f"architecture {arch.name!r} registered by both "
                                  f"{reg.owners[('architecture', arch.name)]!r} and {_owner!r}")
            reg.architectures[arch.name] = arch
            reg.owners[("architecture", arch.name)] = _owner
        fn(register=register_arch)
    keyed("tandem_weight_formats", "weight_format", reg.weight_formats)
    keyed("tandem_drafters", "drafter", reg.drafters)
    keyed("tandem_tool_formats", "tool_format", reg.tool_formats)
    keyed("tandem_cache_tiers", "cache_tier", reg.cache_tiers)
    for owner, fn in each("tandem_cli_commands"):
        def register_cmd(name: str, help: str, configure: Callable, run: Callable, _owner: str = owner) -> None:
            if name in reg.cli_commands:
                raise PluginError(f"command {name!r} registered by both "
                                  f"{reg.owners[('command', name)]!r} and {_owner!r}")
            reg.cli_commands[name] = (help, configure, run)
            reg.owners[("command", name)] = _owner
        fn(register=register_cmd)
    for owner, fn in each("tandem_model_entries"):
        def register_dir(path: Any, _owner: str = owner) -> None:
            reg.model_entries.append(str(path))
            reg.owners[("model_entries", str(path))] = _owner
        fn(register=register_dir)
    return reg


def registries() -> Registries:
    """The registries, collected from every loaded plugin (recollected after a plugin is added or removed)."""
    load_plugins()
    with _host.lock:
        if _host._reg is None:
            _host._reg = _collect()
        return _host._reg


def loaded_plugins() -> list[PluginInfo]:
    reg = registries()
    out: list[PluginInfo] = []
    for name, _plugin in _host.pm.list_name_plugin():
        dist, version = _host.dists.get(name, (None, None))
        if name in _host.defaults:
            dist, version = "tandem-core", md.version("tandem-core") if _has_dist("tandem-core") else None
        info = PluginInfo(name, dist, version, name in _host.defaults)
        for (kind, item), owner in reg.owners.items():
            if owner == name:
                info.registered.setdefault(kind, []).append(item)
        out.append(info)
    return sorted(out, key=lambda p: (not p.default, p.name))


def _has_dist(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


def import_string(path: str) -> Any:
    """``"package.module:Name"`` -> the object. Fails naming the path."""
    mod, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"import path {path!r} is not of the form 'module:Name'")
    try:
        obj: Any = importlib.import_module(mod)
    except ImportError as exc:
        raise ImportError(f"cannot import {mod!r} (from {path!r}): {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{mod!r} has no attribute {part!r} (from {path!r})") from None
    return obj


def settings_hook(*settings: Setting) -> Callable[..., None]:
    """Build a ``tandem_settings`` implementation that declares ``settings``."""

    @hookimpl
    def tandem_settings(register: Callable[[Setting], Any]) -> None:
        for s in settings:
            register(s)

    return tandem_settings
