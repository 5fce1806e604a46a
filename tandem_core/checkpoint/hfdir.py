"""The steps every family's ``serve`` takes on a Hugging Face checkpoint directory, written once.

    raw = read_config_json(d, family)          config.json (and tokenizer.json) there and readable
    n   = context_for(args.max_context, cfg.max_position_embeddings, ctx)
    c   = prefill_chunk_for(requested, device, cpu=512, cuda=8192)
    ids = stop_ids(d, tokenizer, cfg.eos_token_ids)

Each refuses with a ``ServeError`` (or the config reader's ``ConfigError``) whose message names the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tandem_core.checkpoint.config import ConfigError

__all__ = ["ServeError", "read_config_json", "context_for", "prefill_chunk_for", "stop_ids"]


class ServeError(RuntimeError):
    """A checkpoint directory that cannot be served; the message names the file."""


def read_config_json(d: Path, family: str, needs: Sequence[str] = ("config.json", "tokenizer.json")) -> dict[str, Any]:
    """``d/config.json`` parsed, after checking that every file of ``needs`` is there."""
    for name in needs:
        if not (d / name).exists():
            raise ServeError(f"{d}: no {name} (a {family} checkpoint directory needs the model's {name})")
    try:
        raw = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ServeError(f"{d / 'config.json'}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ServeError(f"{d / 'config.json'}: not a JSON object")
    return raw


def context_for(requested: int, model_max: int, ctx: Any) -> int:
    """The context the engine holds: ``requested``, capped (with a log line) at the model's positions."""
    n = int(requested)
    if n > model_max:
        ctx.log(f"max_context {n} exceeds the model's max_position_embeddings {model_max}; using {model_max}")
        return int(model_max)
    return n


def prefill_chunk_for(requested: int, device: Any, *, cpu: int, cuda: int) -> int:
    """The prefill chunk: ``requested`` when positive, else the device's default (``cuda`` rows on a CUDA
    device, ``cpu`` elsewhere)."""
    if int(requested) < 0:
        raise ServeError(f"prefill_chunk {requested}: must be positive (or 0 for the device's default)")
    if int(requested) > 0:
        return int(requested)
    return cuda if str(device).startswith("cuda") else cpu


def stop_ids(d: Path, tokenizer: Any, config_eos: Sequence[int]) -> tuple[int, ...]:
    """The ids that end a turn: the tokenizer's end tokens and the config's ``eos_token_id``; none is an error."""
    ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *config_eos]))
    if not ids:
        raise ConfigError(f"{d}: no stop token: tokenizer_config.json names no eos_token and neither "
                          f"config.json nor generation_config.json has an eos_token_id")
    return ids
