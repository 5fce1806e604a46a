"""The one loader: what the user asked for -> a checkpoint -> its architecture -> the plugin's ``serve``.

Nothing here knows a model family. A directory is read through its
``config.json``; a ``.gguf`` file through its ``general.architecture`` metadata
(mapped to a raw config ``{"model_type": ..., "format": "gguf"}``). The
registry's ``Arch`` for it names the ``serve`` function that builds the rest.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem_core import catalog
from tandem_core.devices import check_runs
from tandem_core.registry import Arch, architecture
from tandem_core.serving import ServeArgs, ServeContext, Served

__all__ = ["raw_config", "load_served", "arch_for"]


class LoadError(RuntimeError):
    """A checkpoint that cannot be served: the message names the file and what is wrong."""


def raw_config(path: Path) -> dict[str, Any]:
    """The checkpoint's raw config: ``config.json`` for a directory, GGUF metadata for a ``.gguf`` file."""
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.exists():
            raise LoadError(f"{path}: no config.json (a checkpoint directory needs one)")
        try:
            return json.loads(cfg.read_text())
        except json.JSONDecodeError as exc:
            raise LoadError(f"{cfg}: not valid JSON ({exc})") from exc
    if path.suffix == ".gguf":
        from tandem_core.checkpoint.gguf import GGUFHeaderError, architecture_of

        try:
            arch = architecture_of(path)
        except GGUFHeaderError as exc:
            raise LoadError(str(exc)) from exc
        return {"model_type": arch, "format": "gguf", "gguf_path": str(path)}
    raise LoadError(f"{path}: not a checkpoint directory or a .gguf file")


def arch_for(path: Path) -> Arch:
    return architecture(raw_config(path))


def load_served(model: str | None, *, weights: str | None = None, args: ServeArgs | None = None,
                ctx: ServeContext | None = None) -> Served:
    """Resolve ``model`` (an id, a path, or None for the default), then build it with its plugin's ``serve``."""
    ctx = ctx or ServeContext()
    model_id, path = catalog.resolve(model, weights)
    ctx.mark("resolve")
    arch = arch_for(path)
    base = args or ServeArgs(model_id=model_id, path=path)
    check_runs(arch, base.device, base.dtype)       # before a weight is read: a device or dtype it cannot run
    serve = arch.load("serve")
    served = serve(replace(base, model_id=model_id, path=path), ctx)
    served.info.setdefault("architecture", arch.name)
    served.info.setdefault("plugin", arch.package)
    served.info.setdefault("path", str(path))
    served.info["load_stages"] = list(ctx.stages)
    return served
