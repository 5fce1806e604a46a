"""The profile file: YAML, checked against a JSON schema; an error names the file, the key and the line.

``load(path)`` -> ``Config``. The format is documented in ``docs/conductor.md``; ``SCHEMA`` is the
contract. Package files (skill texts) are read at load, relative to the profile file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from tandem_core.server.conduct import ConductorError, read_profile_file

__all__ = ["SCHEMA", "Config", "Profile", "Klass", "Monitor", "SideShape", "ClientRule", "load"]

_NAME = {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_-]{0,39}$"}
_SWITCH = {"type": "boolean"}

SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["profiles"],
    "properties": {
        "conductor": {"type": "string"},
        "model_name": {"type": "string", "minLength": 1},
        "default_profile": _NAME,
        "journal": {"type": "string"},
        "notes_store": {"type": "string"},
        "packages": {
            "type": "object",
            "propertyNames": _NAME,
            "additionalProperties": {
                "type": "object", "additionalProperties": False,
                "properties": {"file": {"type": "string"}, "text": {"type": "string"}},
                "oneOf": [{"required": ["file"]}, {"required": ["text"]}],
            },
        },
        "clients": {
            "type": "array",
            "items": {
                "type": "object", "additionalProperties": False, "required": ["profile"],
                "properties": {
                    "name": {"type": "string"},
                    "user_agent": {"type": "string", "minLength": 1},
                    "tools": _SWITCH,
                    "stream": _SWITCH,
                    "profile": _NAME,
                },
            },
        },
        "profiles": {
            "type": "object", "minProperties": 1, "propertyNames": _NAME,
            "additionalProperties": {
                "type": "object", "additionalProperties": False, "required": ["classes"],
                "properties": {
                    "classes": {
                        "type": "object", "minProperties": 1, "propertyNames": _NAME,
                        "additionalProperties": {
                            "type": "object", "additionalProperties": False,
                            "properties": {
                                "description": {"type": "string"},
                                "thinking_budget": {"type": "integer", "minimum": 0},
                                "effort": {"type": "string"},
                                "rules": {"type": "array", "items": {"type": "string"}},
                                "packages": {"type": "array", "items": _NAME},
                            },
                        },
                    },
                    "default_class": _NAME,
                    "classifier": {"enum": ["model", "none"]},
                    "status_lines": _SWITCH,
                    "memory_notes": _SWITCH,
                    "memory_writer": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"quiet_s": {"type": "number", "exclusiveMinimum": 0},
                                       "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1024}},
                    },
                    "efforts": {
                        "type": "object", "additionalProperties": False,
                        "properties": {k: {"type": "integer", "minimum": 0}
                                       for k in ("none", "minimal", "low", "medium", "high")},
                    },
                    "monitor": {
                        "type": "object", "additionalProperties": False,
                        "properties": {
                            "loop": {"type": "object", "additionalProperties": False, "properties": {
                                "enabled": _SWITCH, "ngram": {"type": "integer", "minimum": 2},
                                "repeats": {"type": "integer", "minimum": 2},
                                "window": {"type": "integer", "minimum": 8}}},
                            "empty_turn": {"type": "object", "additionalProperties": False, "properties": {
                                "enabled": _SWITCH, "text": {"type": "string"}}},
                            "tool_repair": {"type": "object", "additionalProperties": False, "properties": {
                                "enabled": _SWITCH, "regenerate": _SWITCH}},
                            "repeated_calls": {"type": "object", "additionalProperties": False, "properties": {
                                "enabled": _SWITCH, "repeats": {"type": "integer", "minimum": 1}}},
                        },
                    },
                    "side_requests": {
                        "type": "array",
                        "items": {
                            "type": "object", "additionalProperties": False, "required": ["name", "roles"],
                            "properties": {
                                "name": _NAME,
                                "roles": {"type": "array", "minItems": 1,
                                          "items": {"enum": ["system", "developer", "user", "assistant", "tool"]}},
                                "tools": _SWITCH,
                                "stream": _SWITCH,
                                "system_contains": {"type": "string"},
                                "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
                            },
                        },
                    },
                },
            },
        },
    },
}


@dataclass(frozen=True)
class Klass:
    name: str
    description: str
    thinking_budget: int | None
    effort: str
    rules: tuple[str, ...]
    packages: tuple[str, ...]


@dataclass(frozen=True)
class Monitor:
    loop: bool = True
    ngram: int = 6
    repeats: int = 4
    window: int = 512
    empty_turn: bool = True
    empty_text: str = "\n\n"
    tool_repair: bool = True
    regenerate: bool = True
    repeated_calls: bool = True
    call_repeats: int = 1         # an identical call already made this many times in a row: stopped


@dataclass(frozen=True)
class SideShape:
    name: str
    roles: tuple[str, ...]
    tools: bool | None
    stream: bool | None
    system_contains: str | None
    max_tokens: int


@dataclass(frozen=True)
class Profile:
    name: str
    classes: dict[str, Klass]
    default_class: str
    classifier: str
    status_lines: bool
    memory_notes: bool
    efforts: dict[str, int]
    writer_quiet_s: float | None        # memory_writer: a session quiet this long gets its facts written as notes
    writer_tokens: int
    monitor: Monitor
    side_requests: tuple[SideShape, ...]


@dataclass(frozen=True)
class ClientRule:
    name: str
    user_agent: re.Pattern[str] | None
    tools: bool | None
    stream: bool | None
    profile: str


@dataclass(frozen=True)
class Config:
    path: Path
    model_name: str
    profiles: dict[str, Profile]
    default_profile: str
    clients: tuple[ClientRule, ...]
    packages: dict[str, str]
    journal: Path | None
    notes_store: Path | None
    lines: dict[tuple[Any, ...], int] = field(default_factory=dict)


EFFORTS = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": 8192}


def _plain(node: Any, path: tuple[Any, ...], lines: dict[tuple[Any, ...], int]) -> Any:
    """A composed YAML node -> plain data, remembering each key's line (1-based) by its path."""
    import yaml

    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for k, v in node.value:
            key = yaml.safe_load(yaml.serialize(k)) if not isinstance(k, yaml.ScalarNode) else k.value
            lines[(*path, key)] = k.start_mark.line + 1
            out[key] = _plain(v, (*path, key), lines)
            lines[(*path, key)] = k.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_plain(v, (*path, i), lines) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))


def _where(path: tuple[Any, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top)"


def _fail(cfg_path: Path, lines: dict[tuple[Any, ...], int], path: tuple[Any, ...], message: str) -> ConductorError:
    probe = tuple(path)
    while probe and probe not in lines:
        probe = probe[:-1]
    line = lines.get(probe, 1)
    return ConductorError(f"{cfg_path}: line {line}: {_where(path)}: {message}")


def check(path: Path) -> tuple[dict[str, Any], dict[tuple[Any, ...], int]]:
    """The file's data, schema-checked; ``ConductorError`` (file, line, key) otherwise."""
    node, _text = read_profile_file(path)
    if node is None:
        raise ConductorError(f"{path}: line 1: (top): the file is empty; it needs profiles")
    lines: dict[tuple[Any, ...], int] = {}
    data = _plain(node, (), lines)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        err = errors[0]
        where = tuple(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = set((err.schema.get("properties") or {}))
            extra = sorted(k for k in err.instance if k not in allowed)
            if extra:
                known = ", ".join(sorted(allowed))
                raise _fail(path, lines, (*where, extra[0]), f"unknown key (known: {known})")
        if err.validator == "propertyNames":
            raise _fail(path, lines, where, f"a name must match {_NAME['pattern']}: {err.message}")
        raise _fail(path, lines, where, err.message)
    _cross(path, data, lines)
    return data, lines


def _cross(path: Path, data: dict[str, Any], lines: dict[tuple[Any, ...], int]) -> None:
    """What the schema cannot say: names that must exist, regexes that must compile."""
    profiles = data["profiles"]
    packages = data.get("packages") or {}
    if "default_profile" in data and data["default_profile"] not in profiles:
        raise _fail(path, lines, ("default_profile",), f"names {data['default_profile']!r}, which is not in profiles")
    if "default_profile" not in data and len(profiles) > 1:
        raise _fail(path, lines, ("profiles",), "several profiles: default_profile must name one")
    for i, rule in enumerate(data.get("clients") or []):
        if rule["profile"] not in profiles:
            raise _fail(path, lines, ("clients", i, "profile"), f"names {rule['profile']!r}, which is not in profiles")
        if "user_agent" in rule:
            try:
                re.compile(rule["user_agent"])
            except re.error as exc:
                raise _fail(path, lines, ("clients", i, "user_agent"), f"is not a regular expression: {exc}") from None
    for pname, prof in profiles.items():
        classes = prof["classes"]
        if "default_class" in prof and prof["default_class"] not in classes:
            raise _fail(path, lines, ("profiles", pname, "default_class"),
                        f"names {prof['default_class']!r}, which is not in classes")
        for cname, klass in classes.items():
            for j, pkg in enumerate(klass.get("packages") or []):
                if pkg not in packages:
                    raise _fail(path, lines, ("profiles", pname, "classes", cname, "packages", j),
                                f"names {pkg!r}, which is not in packages")
    for name, pkg in packages.items():
        if "file" in pkg:
            f = (Path(path).parent / pkg["file"]).expanduser()
            if not f.is_file():
                raise _fail(path, lines, ("packages", name, "file"), f"{f} is not a readable file")


def load(path: Path) -> Config:
    path = Path(path)
    data, lines = check(path)
    base = path.parent
    packages: dict[str, str] = {}
    for name, pkg in (data.get("packages") or {}).items():
        packages[name] = pkg["text"] if "text" in pkg else (base / pkg["file"]).expanduser().read_text().strip()
    profiles: dict[str, Profile] = {}
    for pname, p in data["profiles"].items():
        classes = {c: Klass(c, k.get("description", c), k.get("thinking_budget"), k.get("effort", ""),
                            tuple(k.get("rules") or ()), tuple(k.get("packages") or ()))
                   for c, k in p["classes"].items()}
        m = p.get("monitor") or {}
        loop, empty = m.get("loop") or {}, m.get("empty_turn") or {}
        repair, rep = m.get("tool_repair") or {}, m.get("repeated_calls") or {}
        monitor = Monitor(loop=loop.get("enabled", True), ngram=loop.get("ngram", 6), repeats=loop.get("repeats", 4),
                          window=loop.get("window", 512), empty_turn=empty.get("enabled", True),
                          empty_text=empty.get("text", "\n\n"), tool_repair=repair.get("enabled", True),
                          regenerate=repair.get("regenerate", True), repeated_calls=rep.get("enabled", True),
                          call_repeats=rep.get("repeats", 1))
        sides = tuple(SideShape(s["name"], tuple(s["roles"]), s.get("tools"), s.get("stream"),
                                s.get("system_contains"), s.get("max_tokens", 64))
                      for s in p.get("side_requests") or ())
        profiles[pname] = Profile(pname, classes, p.get("default_class", next(iter(classes))),
                                  p.get("classifier", "model"), bool(p.get("status_lines", False)),
                                  bool(p.get("memory_notes", False)), {**EFFORTS, **(p.get("efforts") or {})},
                                  (p["memory_writer"].get("quiet_s", 120.0) if "memory_writer" in p else None),
                                  (p.get("memory_writer") or {}).get("max_tokens", 128), monitor, sides)
    clients = tuple(ClientRule(r.get("name", r["profile"]),
                               re.compile(r["user_agent"]) if "user_agent" in r else None,
                               r.get("tools"), r.get("stream"), r["profile"]) for r in data.get("clients") or ())

    def where(key: str) -> Path | None:
        return (base / data[key]).expanduser() if key in data else None

    return Config(path, data.get("model_name", "TandemLLM"), profiles,
                  data.get("default_profile", next(iter(profiles))), clients, packages, where("journal"),
                  where("notes_store"), lines)
