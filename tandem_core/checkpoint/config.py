"""The strict config reader: a model lists what it READS, what it IGNORES, and what is FIXED.

An unknown field, or a FIXED field with another value, stops the load naming the
field: a config the engine would silently misread is worse than one it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ConfigError", "FieldPolicy", "read_strict", "split_text_config"]


class ConfigError(ValueError):
    """A config field the model does not know, or a fixed field with a value it cannot compute."""


_ABSENT = object()


@dataclass(frozen=True)
class FieldPolicy:
    """``read``: fields the engine uses; ``ignored``: training-only or bookkeeping fields;
    ``fixed``: field -> the only value(s) the engine's arithmetic implements (a tuple allows several;
    an absent fixed field is taken at its default)."""

    read: frozenset[str]
    ignored: frozenset[str] = frozenset()
    fixed: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, read: Any, ignored: Any = (), fixed: Mapping[str, Any] | None = None) -> None:
        object.__setattr__(self, "read", frozenset(read))
        object.__setattr__(self, "ignored", frozenset(ignored))
        object.__setattr__(self, "fixed", dict(fixed or {}))


def read_strict(raw: Mapping[str, Any], policy: FieldPolicy, where: str = "config.json") -> dict[str, Any]:
    """The READ fields of ``raw`` (absent ones left out); refuse unknown fields and FIXED violations."""
    for key, value in raw.items():
        if key in policy.fixed:
            allowed = policy.fixed[key]
            allowed = allowed if isinstance(allowed, tuple) else (allowed,)
            if value not in allowed:
                raise ConfigError(
                    f"{where}: field {key!r} = {value!r} is fixed at {' or '.join(map(repr, allowed))}: "
                    f"the engine does not implement another value"
                )
        elif key not in policy.read and key not in policy.ignored:
            raise ConfigError(f"{where}: unknown field {key!r}: the engine does not know what it changes")
    return {k: raw[k] for k in policy.read if k in raw}


def split_text_config(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(text, outer)``: a vision-language config keeps its text model under ``text_config``;
    a text-only config has the keys at the top level (then ``outer`` is empty)."""
    if isinstance(raw.get("text_config"), Mapping):
        outer = {k: v for k, v in raw.items() if k != "text_config"}
        return dict(raw["text_config"]), outer
    return dict(raw), {}


# -- typed fields: every family's reader names the field and the file when a value is wrong -------------
def int_field(raw: Mapping[str, Any], key: str, where: str, default: Any = None, minimum: int = 1) -> int:
    """``raw[key]`` (or ``default``) as an integer ``>= minimum``; missing (no default) or another value refused."""
    value = raw.get(key, default)
    if value is None:
        raise ConfigError(f"{where}: field {key!r} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
        raise ConfigError(f"{where}: field {key!r} = {value!r} is not {kind}")
    return value


def float_field(raw: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: field {key!r} = {value!r} is not a number")
    return float(value)


def bool_field(raw: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: field {key!r} = {value!r} is not a boolean")
    return value


def token_ids(value: Any, key: str, where: str) -> tuple[int, ...]:
    """A token id or a list of them (``eos_token_id``) as a tuple; None is ``()``."""
    if value is None:
        return ()
    values = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if values is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}: field {key!r} = {value!r} is not a token id or a list of them")
    return tuple(values)
