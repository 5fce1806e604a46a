"""The backends file (``--backends FILE``): YAML checked against ``backends.schema.json``.

``load_backends(path)`` returns ``Backends`` or raises ``BackendsError`` whose message names the file, the
line and the key: ``backends.yaml:7: backends[0].timeouts.read: -1 is not greater than 0``. Besides the schema
it refuses two backends of one name, a model named by two backends, and an ``api_key_env`` that is not set.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

__all__ = ["SCHEMA_PATH", "Backend", "Backends", "BackendsError", "load_backends", "parse_backends"]

SCHEMA_PATH = Path(str(files("tandem_core.proxy").joinpath("backends.schema.json")))


class BackendsError(ValueError):
    """A backends file that is not valid: the message names the file, the line and the key."""


@dataclass(frozen=True)
class Backend:
    name: str
    url: str                        # the base URL of its OpenAI API, without a trailing slash
    models: tuple[str, ...] | None  # None: "ask" (read from its GET /v1/models)
    api_key: str | None             # read from api_key_env when the file is loaded
    api_key_env: str | None
    connect_s: float = 5.0
    read_s: float = 300.0
    health_s: float = 5.0
    health_every_s: float = 15.0
    price_in: float = 0.0           # per million prompt tokens
    price_out: float = 0.0          # per million completion tokens
    stream_usage: bool = True       # ask for stream_options.include_usage on a stream without it

    @property
    def ask(self) -> bool:
        return self.models is None

    @property
    def shown(self) -> str:
        """The URL as messages, logs and the dashboard show it: credentials in it (``user:pass@``) masked."""
        scheme, sep, rest = self.url.partition("://")
        host, slash, path = rest.partition("/")
        if "@" in host:
            host = "***@" + host.rsplit("@", 1)[1]
        return scheme + sep + host + slash + path

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.price_in + completion_tokens * self.price_out) / 1e6


@dataclass(frozen=True)
class Backends:
    path: Path
    backends: tuple[Backend, ...]
    lines: Mapping[str, int]        # key path ("backends[0].models[1]") -> line, for later refusals

    def where(self, key: str) -> str:
        """``FILE:LINE: KEY`` for a message about one key."""
        line = self.lines.get(key)
        return f"{self.path}:{line}: {key}" if line else f"{self.path}: {key}"

    def check_local(self, local_model: str) -> None:
        """Refuse a backend that claims the model this server serves itself."""
        for i, b in enumerate(self.backends):
            for j, m in enumerate(b.models or ()):
                if m == local_model:
                    raise BackendsError(f"{self.where(f'backends[{i}].models[{j}]')}: {m!r} is the model this "
                                        f"server serves itself; a request for it stays local")


def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def _key(path: list[Any]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _lines(node: yaml.Node | None, path: list[Any], into: dict[str, int]) -> None:
    """Every key path's line (1-based) in the composed YAML."""
    if node is None:
        return
    into[_key(path)] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            sub = path + [k.value]
            into[_key(sub)] = k.start_mark.line + 1
            _lines(v, sub, into)
            into[_key(sub)] = k.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _lines(v, path + [i], into)


def _schema_message(err: Any) -> tuple[list[Any], str]:
    """The key a schema error is about and a short message (the offending key, not its parent)."""
    path = list(err.absolute_path)
    if err.validator == "additionalProperties":
        m = re.search(r"\('([^']+)' (?:was|were) unexpected", err.message)
        extra = m.group(1) if m else "?"
        allowed = ", ".join(sorted(err.schema.get("properties", {})))
        return path + [extra], f"unknown key; the keys here are {allowed}"
    if err.validator == "required":
        m = re.match(r"'([^']+)' is a required property", err.message)
        return path + [m.group(1) if m else "?"], "required, missing"
    if err.validator == "oneOf" and path and path[-1] == "models":
        return path, 'a list of model names, or "ask" (read them from its GET /v1/models)'
    if err.validator == "pattern" and path and path[-1] == "url":
        return path, f"{err.instance!r} is not an http:// or https:// URL"
    if err.validator == "pattern" and path and path[-1] == "name":
        return path, f"{err.instance!r}: letters, digits, '.', '_' and '-' only, at most 64"
    return path, err.message


def parse_backends(text: str, path: Path, env: Mapping[str, str] | None = None) -> Backends:
    import jsonschema

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise BackendsError(f"{where}: not valid YAML ({problem})") from None
    lines: dict[str, int] = {}
    _lines(node, [], lines)
    if data is None:
        data = {}

    def fail(key: list[Any] | str, message: str) -> BackendsError:
        k = key if isinstance(key, str) else _key(key)
        line = lines.get(k)
        if line is None and not isinstance(key, str):   # a missing key: the line of the mapping it belongs to
            line = lines.get(_key(key[:-1]))
        return BackendsError(f"{path}:{line}: {k}: {message}" if line else f"{path}: {k}: {message}")

    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: (list(map(str, e.absolute_path)), e.validator))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        key_path, message = _schema_message(best)
        raise fail(key_path, message)

    if env is None:
        from tandem_core.settings import EngineSettings

        env = EngineSettings().env      # the registry's copy of the environment (the one place that reads it)
    seen_names: dict[str, int] = {}
    seen_models: dict[str, str] = {}
    out: list[Backend] = []
    for i, b in enumerate(data["backends"]):
        name = b["name"]
        if name in seen_names:
            raise fail([ "backends", i, "name"], f"{name!r} names backends[{seen_names[name]}] already")
        seen_names[name] = i
        models = None if b["models"] == "ask" else tuple(b["models"])
        for j, m in enumerate(models or ()):
            if m in seen_models:
                raise fail(["backends", i, "models", j], f"{m!r} is served by backend {seen_models[m]!r} already")
            seen_models[m] = name
        key = None
        key_env = b.get("api_key_env")
        if key_env is not None:
            key = env.get(key_env)
            if not key:
                raise fail(["backends", i, "api_key_env"], f"the environment variable {key_env} is not set")
        t = b.get("timeouts", {})
        p = b.get("prices", {})
        out.append(Backend(name=name, url=b["url"].rstrip("/"), models=models, api_key=key, api_key_env=key_env,
                           connect_s=float(t.get("connect", 5.0)), read_s=float(t.get("read", 300.0)),
                           health_s=float(t.get("health", 5.0)), health_every_s=float(b.get("health_every", 15.0)),
                           price_in=float(p.get("input", 0.0)), price_out=float(p.get("output", 0.0)),
                           stream_usage=bool(b.get("stream_usage", True))))
    return Backends(path, tuple(out), lines)


def load_backends(path: str | Path, env: Mapping[str, str] | None = None) -> Backends:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BackendsError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BackendsError(f"{p}: cannot be read ({type(exc).__name__}: {exc})") from None
    return parse_backends(text, p, env)
