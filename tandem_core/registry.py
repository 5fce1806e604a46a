"""The architecture registry: which model family a checkpoint is.

An ``Arch`` names its classes by import path (``"module:Name"``), so registering
a model imports nothing heavy. ``architecture(raw_config)`` returns the entry for
a checkpoint's ``config.json`` or fails naming the checkpoint's architecture and
every registered one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tandem_core.plugins import import_string, registries

__all__ = ["Arch", "UnknownArchitecture", "architecture", "architectures"]


class UnknownArchitecture(LookupError):
    """No registered architecture reads this checkpoint."""


@dataclass(frozen=True)
class Arch:
    """One model family.

    name           the family's registry name (``"qwen3_5"``)
    architectures  the ``architectures`` strings of config.json it reads
    model_types    the ``model_type`` values it reads (top level or under ``text_config``)
    config         ``"module:function"``: ``raw_config -> the model's config object`` (strict)
    package        the distribution that provides it
    serve          ``"module:function"``: ``serve(args, ctx) -> Served`` builds everything the server needs
    runs           the device types and dtypes its runners compute in, e.g. ``(("cpu", ("fp32",)), ("cuda",
                   ("bf16", "fp32")))``: the loader refuses anything else before a weight is read (empty: the
                   plugin's ``serve`` decides)
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    config: str
    package: str
    serve: str
    runs: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def load(self, which: str) -> Any:
        """Import one of ``config`` or ``serve``."""
        return import_string(getattr(self, which))

    def read_config(self, raw: Mapping[str, Any]) -> Any:
        return self.load("config")(raw)


def architectures() -> dict[str, Arch]:
    return dict(registries().architectures)


def _keys(raw: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    archs = list(raw.get("architectures") or [])
    types = [raw.get("model_type")]
    text = raw.get("text_config")
    if isinstance(text, Mapping):
        types.append(text.get("model_type"))
    return archs, [t for t in types if t]


def architecture(raw_config: Mapping[str, Any]) -> Arch:
    """The registered entry that reads this config, by ``architectures`` first, then ``model_type``."""
    archs, types = _keys(raw_config)
    entries = architectures()
    for a in archs:
        for e in entries.values():
            if a in e.architectures:
                return e
    for t in types:
        for e in entries.values():
            if t in e.model_types:
                return e
    known = "; ".join(f"{e.name} ({', '.join(e.architectures)})" for e in entries.values()) or "none"
    raise UnknownArchitecture(
        f"no plugin reads architecture {archs or None} (model_type {types or None}); "
        f"registered: {known}. Install the model's plugin (tandem plugins lists what is loaded)."
    )
