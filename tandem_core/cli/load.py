"""Loading the model for ``tandem run`` and ``tandem serve``: every load error is one line, exit 1.

A plugin's ``serve`` raises what it raises (``ConfigError`` for a field its config reader
refuses, its own ``ServeError``, ``ValueError``, ``FileNotFoundError``...). ``load`` turns any
of them into ``LoadFailed``: the checkpoint's path, then the plugin's message (which names
the file and the field), on one line. Only an interrupt passes through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem_core.cli import LoadFailed

if TYPE_CHECKING:  # the serving records import torch; a refusal before the load must not wait for it
    from tandem_core.serving import ServeArgs, ServeContext, Served

__all__ = ["resolve", "load", "one_line", "placement"]


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type when it has none)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def resolve(model: str | None, weights: str | None) -> tuple[str, str]:
    """``(model id, checkpoint path)`` without loading anything; ``LoadFailed`` when there is none."""
    from tandem_core import catalog

    try:
        model_id, path = catalog.resolve(model, weights)
    except (catalog.ModelNotFound, catalog.RegistryError) as exc:
        raise LoadFailed(one_line(exc)) from None
    return model_id, str(path)


def placement(device: str | None, dtype: str | None) -> tuple[str, str]:
    """``(device, dtype)`` from ``--device`` and ``--dtype``: ``auto`` resolved (the first CUDA device torch sees,
    else the CPU), the dtype defaulting per device (bf16 on CUDA, fp32 on the CPU). A device that is not
    there is a usage error (``CliError``, one line naming it)."""
    from tandem_core.cli import CliError
    from tandem_core.devices import DeviceError, default_dtype, resolve_device

    try:
        dev = resolve_device(device)
    except DeviceError as exc:
        raise CliError(str(exc)) from None
    return dev, dtype or default_dtype(dev)


def load(model: str | None, weights: str | None, args: ServeArgs, ctx: ServeContext) -> Served:
    """The plugin's ``Served`` for ``model``; ``LoadFailed`` (one line: the path, the plugin's message)."""
    from tandem_core.loader import load_served

    _, path = resolve(model, weights)
    try:
        return load_served(model, weights=weights, args=args, ctx=ctx)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001  (any plugin's load error: one line, never a traceback)
        text = one_line(exc)
        raise LoadFailed(text if path in text else f"{path}: {text}") from None
