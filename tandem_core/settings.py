"""The settings registry: every ``TANDEM_*`` switch, its default, owner and meaning.

``SETTINGS.get(name)`` is the only way code reads a switch; a test fails on any
other environment read in the core or the plugins. ``EngineSettings(env, prefix)``
gives the same reads over another mapping (a profile file, a test's dict) or
another prefix.

Plugins declare their own switches through the ``tandem_settings`` hook; the
core's switches are declared here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

__all__ = ["Setting", "SettingsRegistry", "EngineSettings", "SETTINGS", "SettingError"]


class SettingError(ValueError):
    """A switch is unknown, declared twice, or holds a value its type refuses."""


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {raw!r}")


_PARSERS: dict[type, Callable[[str], Any]] = {str: str, int: int, float: float, bool: _parse_bool}


@dataclass(frozen=True)
class Setting:
    """One switch. ``name`` without the prefix (``PLUGINS`` for ``TANDEM_PLUGINS``)."""

    name: str
    default: Any
    owner: str  # the module that reads it
    meaning: str
    type: type = str
    arithmetic: bool = False  # True when another value changes what computed rows hold

    def parse(self, raw: str) -> Any:
        try:
            return _PARSERS[self.type](raw)
        except (ValueError, KeyError) as exc:
            raise SettingError(f"setting {self.name}: {raw!r} is not a valid {self.type.__name__}") from exc


class SettingsRegistry:
    """Declarations of every switch. Holds no values: values come from a mapping at read time."""

    def __init__(self) -> None:
        self._decl: dict[str, Setting] = {}

    def declare(self, setting: Setting) -> Setting:
        old = self._decl.get(setting.name)
        if old is not None and old != setting:
            raise SettingError(f"setting {setting.name} declared twice ({old.owner} and {setting.owner})")
        self._decl[setting.name] = setting
        return setting

    def __iter__(self) -> Iterator[Setting]:
        return iter(sorted(self._decl.values(), key=lambda s: s.name))

    def __contains__(self, name: str) -> bool:
        return _strip(name) in self._decl

    def decl(self, name: str) -> Setting:
        key = _strip(name)
        if key not in self._decl:
            # a plugin's switch is declared when plugins load
            from tandem_core.plugins import load_plugins

            load_plugins()
        try:
            return self._decl[key]
        except KeyError:
            raise SettingError(f"unknown setting TANDEM_{key}; known: {', '.join(self._decl)}") from None

    def get(self, name: str, env: Mapping[str, str] | None = None, prefix: str = "TANDEM_") -> Any:
        """The switch's value from ``env`` (the process environment by default)."""
        s = self.decl(name)
        source = os.environ if env is None else env
        raw = source.get(prefix + s.name)
        return s.default if raw is None else s.parse(raw)

    def arithmetic(self, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Every switch whose value changes computed rows, with its current value (for fingerprints)."""
        return {s.name: self.get(s.name, env) for s in self if s.arithmetic}


def _strip(name: str) -> str:
    return name[len("TANDEM_"):] if name.startswith("TANDEM_") else name


class EngineSettings:
    """The registry's reads over another mapping or prefix: ``EngineSettings({"X_PLUGINS": "a"}, "X_")``."""

    def __init__(self, env: Mapping[str, str] | None = None, prefix: str = "TANDEM_",
                 registry: SettingsRegistry | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.prefix = prefix
        self.registry = registry or SETTINGS

    def get(self, name: str) -> Any:
        return self.registry.get(name, self.env, self.prefix)


SETTINGS = SettingsRegistry()

for _s in (
    Setting("PLUGINS", "", "tandem_core.plugins",
            "comma-separated allow-list of plugin names to load; empty loads every installed plugin"),
    Setting("EXTRA_PLUGINS", "", "tandem_core.plugins",
            "comma-separated importable modules to register as plugins without a distribution "
            "(development and tests)"),
    Setting("DISABLE_ENTRYPOINTS", False, "tandem_core.plugins",
            "load only the core's default plugins, skip the 'tandem' entry points", bool),
    Setting("HOME", "~/.tandem", "tandem_core.paths", "where TandemLLM keeps models, ledger and caches"),
    Setting("HF_CACHE", "~/.cache/huggingface/hub", "tandem_core.catalog",
            "the Hugging Face hub cache searched for registry models"),
    Setting("REGISTRY", "", "tandem_core.catalog",
            "extra folder of models/<id>/model.yaml entries, searched before the shipped ones"),
    Setting("CUDA_PDL", False, "tandem_core.ops.triton_pdl",
            "launch the CUDA graph step's Triton kernels with programmatic dependent launch on compute "
            "capability >= 9 (each kernel starts while the one before it drains; ordering unchanged; "
            "measured on an H200: no gain in decode, 4 % slower verify, so off)", bool),
    Setting("THREADS", 0, "tandem_core.cli.main", "torch CPU threads (0: torch's default)", int),
    Setting("LOG_LEVEL", "INFO", "tandem_core.logs", "log level of the tandem loggers"),
):
    SETTINGS.declare(_s)
