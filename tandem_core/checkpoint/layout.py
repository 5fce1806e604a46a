"""How a checkpoint names its tensors, in one place.

The engine addresses every tensor by a canonical name: ``embed_tokens.weight``,
``lm_head.weight``, ``norm.weight``, ``layers.N.<module>.<proj>.weight`` — the
language model's own naming with the checkpoint's wrapper prefix taken off.
Vision tensors (and other towers the text engine does not read) are skipped by
name and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["Layout", "LayoutResult"]


@dataclass(frozen=True)
class LayoutResult:
    names: dict[str, str]              # canonical -> checkpoint key
    skipped: dict[str, int]            # skipped prefix -> count
    head_tied: bool                    # lm_head reads the embedding


@dataclass(frozen=True)
class Layout:
    # longest first: the first matching prefix is taken off
    prefixes: tuple[str, ...] = ("model.language_model.", "language_model.model.", "language_model.", "model.")
    skip: tuple[str, ...] = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.",
                             "model.multi_modal_projector.", "mtp.")
    head_names: tuple[str, ...] = ("lm_head.weight", "language_model.lm_head.weight")
    extra_skip: tuple[str, ...] = field(default=())

    def canonical(self, key: str) -> str | None:
        """The canonical name of a checkpoint key, or None when the key is skipped."""
        if any(key.startswith(p) for p in self.skip + self.extra_skip):
            return None
        if key in self.head_names:
            return "lm_head.weight"
        for p in self.prefixes:
            if key.startswith(p):
                return key[len(p):]
        return key

    def resolve(self, keys: Iterable[str], tie_word_embeddings: bool) -> LayoutResult:
        names: dict[str, str] = {}
        skipped: dict[str, int] = {}
        for key in keys:
            canon = self.canonical(key)
            if canon is None:
                pref = next(p for p in self.skip + self.extra_skip if key.startswith(p))
                skipped[pref] = skipped.get(pref, 0) + 1
                continue
            if canon in names:
                raise ValueError(f"tensors {names[canon]!r} and {key!r} both read as {canon!r}")
            names[canon] = key
        tied = False
        if "lm_head.weight" not in names:
            if not tie_word_embeddings:
                raise ValueError("checkpoint has no lm_head.weight and its config does not tie the head "
                                 "to the embedding (tie_word_embeddings is false)")
            if "embed_tokens.weight" in names:
                names["lm_head.weight"] = names["embed_tokens.weight"]
                tied = True
        elif tie_word_embeddings and names["lm_head.weight"] == names.get("embed_tokens.weight"):
            tied = True
        return LayoutResult(names, skipped, tied)
