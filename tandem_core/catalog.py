"""The model registry: ``tandem_core/shipped/models/<id>/model.yaml`` entries (schema 1), and where a model's files are.

``entries()`` reads every entry from the folders registered through the
``tandem_model_entries`` hook (the core registers its shipped ``tandem_core/shipped/``, found
with ``importlib.resources`` so an installed wheel finds it;
``TANDEM_REGISTRY`` adds one). ``check()`` refuses an entry whose numbers do not
add up. ``resolve(model, weights)`` turns what the user typed (an id, a path, or
nothing for the default) into a local path, or fails saying where it looked and
what to download.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from tandem_core.settings import SETTINGS

__all__ = [
    "SCHEMA_PATH",
    "Entry",
    "ModelNotFound",
    "RegistryError",
    "check",
    "check_entry",
    "default_entry",
    "entries",
    "entry",
    "home",
    "resolve",
    "schema",
]

SHIPPED = Path(str(files("tandem_core").joinpath("shipped")))   # models/, prices/, schema/ inside the package
SCHEMA_PATH = SHIPPED / "schema" / "model.schema.json"
_GIB = 1 << 30


class RegistryError(ValueError):
    """A model.yaml that is malformed or whose numbers do not add up."""


class ModelNotFound(LookupError):
    """A model whose files are not on this machine (the message says where it looked and what to fetch)."""


@dataclass(frozen=True)
class Entry:
    id: str
    path: Path              # the model.yaml
    data: dict[str, Any]

    @property
    def source(self) -> dict[str, Any]:
        return dict(self.data.get("source", {}))


def _checkout() -> Path | None:
    """The source checkout this core runs from (``docs/`` beside the package), or None for an installed wheel:
    an entry's ``docs`` link names a page of the repository, checked only where the repository is."""
    root = SHIPPED.parent.parent
    return root if (root / "docs").is_dir() and (root / "pyproject.toml").is_file() else None


def home() -> Path:
    return Path(str(SETTINGS.get("HOME"))).expanduser()


def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def _dirs() -> list[Path]:
    from tandem_core.plugins import registries

    out: list[Path] = []
    extra = str(SETTINGS.get("REGISTRY"))
    if extra:
        out.append(Path(extra).expanduser())
    out.extend(Path(p) for p in registries().model_entries)
    return out


def _read(path: Path) -> Entry:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RegistryError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise RegistryError(f"{path}: not a mapping")
    return Entry(str(data.get("id", path.parent.name)), path, data)


def entries(dirs: Iterable[Path] | None = None) -> dict[str, Entry]:
    """Every entry by id; an earlier folder wins over a later one (``TANDEM_REGISTRY`` over the shipped)."""
    out: dict[str, Entry] = {}
    for d in (list(dirs) if dirs is not None else _dirs()):
        for path in sorted((d / "models").glob("*/model.yaml")):
            e = _read(path)
            out.setdefault(e.id, e)
    return out


def entry(model_id: str) -> Entry:
    all_ = entries()
    try:
        return all_[model_id]
    except KeyError:
        raise ModelNotFound(f"no registry entry {model_id!r}; known: {', '.join(sorted(all_)) or 'none'}") from None


def default_entry() -> Entry:
    defaults = [e for e in entries().values() if e.data.get("default")]
    if not defaults:
        raise ModelNotFound("no registry entry is marked default: give --model")
    return defaults[0]


# -- the check ------------------------------------------------------------------------------
def check_entry(e: Entry, repo_root: Path | None = None) -> list[str]:
    """Every problem with one entry (empty when it is sound)."""
    import jsonschema

    problems: list[str] = []
    d = e.data
    validator = jsonschema.Draft202012Validator(schema())
    for err in sorted(validator.iter_errors(d), key=lambda x: list(x.path)):
        where = "/".join(map(str, err.path)) or "(top)"
        problems.append(f"{e.path}: {where}: {err.message}")
    if problems:
        return problems
    if e.path.parent.name != d["id"]:
        problems.append(f"{e.path}: folder {e.path.parent.name!r} is not named after id {d['id']!r}")
    profiles = d["profiles"]
    names = [p["name"] for p in profiles]
    if len(set(names)) != len(names):
        problems.append(f"{e.path}: profile names repeat: {names}")
    rec = [p["name"] for p in profiles if p["recommended"]]
    if len(rec) != 1:
        problems.append(f"{e.path}: exactly one profile must be recommended, found {len(rec)} ({rec})")
    for p in profiles:
        bits = p.get("bits_per_param")
        if bits is not None:
            want = d["params"] * 1e9 * bits / 8 / _GIB
            if abs(want - p["weights_gib"]) > 0.02 * want + 0.01:
                problems.append(f"{e.path}: profile {p['name']!r}: {d['params']} B params at {bits} bits is "
                                f"{want:.2f} GiB, not weights_gib {p['weights_gib']}")
    shape, mem = d.get("shape", {}), d.get("memory", {})
    if "kv_bytes_per_token" in mem and all(k in shape for k in ("attention_layers", "kv_heads", "head_dim")):
        size = {"bf16": 2, "fp16": 2, "fp32": 4}[mem.get("kv_dtype", "bf16")]
        want = shape["attention_layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * size
        if want != mem["kv_bytes_per_token"]:
            problems.append(f"{e.path}: memory.kv_bytes_per_token {mem['kv_bytes_per_token']} does not match the "
                            f"shape ({shape['attention_layers']} layers x K,V x {shape['kv_heads']} heads x "
                            f"{shape['head_dim']} x {size} bytes = {want})")
    for t in d.get("tools", []):
        if "needs_profile" in t and t["needs_profile"] not in names:
            problems.append(f"{e.path}: tool {t['name']!r} needs profile {t['needs_profile']!r}, which is not listed")
        for key in t.get("settings", []):
            if key not in SETTINGS:
                problems.append(f"{e.path}: tool {t['name']!r} names setting {key!r}, which nothing declares")
    if "docs" in d:
        root = repo_root or _checkout()
        if root is not None and not (root / d["docs"]).exists():
            problems.append(f"{e.path}: docs link {d['docs']!r} is not there")
    for name, spec in (d.get("drafters") or {}).items():
        src = spec["source"]
        if src["kind"] == "registry":
            folder = e.path.parent / src["path"]
            for fname, f in spec["files"].items():
                path = folder / fname
                if not path.is_file():
                    problems.append(f"{e.path}: drafter {name!r} file {path} is not there")
                elif path.stat().st_size != f["bytes"]:
                    problems.append(f"{e.path}: drafter {name!r} file {fname} is {path.stat().st_size} bytes, the "
                                    f"entry says {f['bytes']}")
    numbers = _number_paths(d)
    sources = d.get("sources", {})
    for path in numbers:
        if path not in sources and path.split(".")[0] not in sources:
            problems.append(f"{e.path}: number {path!r} has no source (add it under 'sources')")
    for key in sources:
        if key not in numbers and not any(n.startswith(key + ".") for n in numbers):
            problems.append(f"{e.path}: 'sources' names {key!r}, which is not a number in the entry")
    return problems


def _number_paths(d: dict[str, Any]) -> list[str]:
    out: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, bool):
            return
        if isinstance(node, (int, float)):
            out.append(path)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                key = v.get("name", str(i)) if isinstance(v, dict) else str(i)
                walk(v, f"{path}.{key}")

    for k, v in d.items():
        if k not in ("schema", "sources", "drafters"):   # a drafter's sizes are checked against its files
            walk(v, k)
    return out


def check(dirs: Iterable[Path] | None = None) -> list[str]:
    problems: list[str] = []
    found = entries(dirs)
    for e in found.values():
        problems.extend(check_entry(e))
    defaults = [e.id for e in found.values() if e.data.get("default")]
    if len(defaults) > 1:
        problems.append(f"more than one default model: {defaults}")
    return problems


# -- where a model's files are ------------------------------------------------------------------
def _hf_snapshot(repo: str, revision: str | None) -> Path | None:
    base = Path(str(SETTINGS.get("HF_CACHE"))).expanduser() / ("models--" + repo.replace("/", "--"))
    ref = base / "refs" / (revision or "main")
    if ref.exists():
        snap = base / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").exists():
            return snap
    snaps = sorted((base / "snapshots").glob("*/config.json")) if (base / "snapshots").exists() else []
    return snaps[-1].parent if snaps else None


def local_paths(e: Entry) -> list[Path]:
    """Where this entry's files may be, in the order looked at."""
    src = e.source
    out = [home() / "models" / e.id]
    if src.get("kind") == "hf":
        base = Path(str(SETTINGS.get("HF_CACHE"))).expanduser() / ("models--" + src["repo"].replace("/", "--"))
        out.append(base)
    return out


def find_local(e: Entry) -> Path | None:
    """The model's checkpoint (a directory with config.json, or the single weights file), or None."""
    src = e.source
    w = e.data.get("weights", {})
    mine = home() / "models" / e.id
    if w.get("file") and (mine / w["file"]).exists():
        return mine / w["file"]
    if (mine / "config.json").exists():
        return mine
    if src.get("kind") == "hf":
        return _hf_snapshot(src["repo"], src.get("revision"))
    return None


def resolve(model: str | None, weights: str | None = None) -> tuple[str, Path]:
    """``(model_id, path)`` for what the user asked: a path, a registry id, or nothing (the default)."""
    if weights:
        p = Path(weights).expanduser()
        if not p.exists():
            raise ModelNotFound(f"--weights {weights}: no such file or directory")
        return model or (p.stem if p.is_file() else p.name), p
    if model is not None:
        p = Path(model).expanduser()
        if p.exists() and (p.is_file() or (p / "config.json").exists()):
            return (p.stem if p.is_file() else p.name), p
        if ("/" in model or model.startswith(".")) and model not in entries():
            raise ModelNotFound(f"--model {model}: no checkpoint there (a directory needs config.json)")
    e = entry(model) if model is not None else default_entry()
    found = find_local(e)
    if found is not None:
        return e.id, found
    looked = ", ".join(str(p) for p in local_paths(e))
    src = e.source
    if src.get("kind") == "hf":
        how = (f"download it with `tandem pull {e.id}` (needs huggingface_hub and a network) or "
               f"`huggingface-cli download {src['repo']}`, or pass --weights PATH")
    else:
        how = f"fetch it with `tandem pull {e.id}`, or pass --weights PATH"
    raise ModelNotFound(f"model {e.id!r} is not on this machine (looked in {looked}); {how}")
