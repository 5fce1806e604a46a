"""Decoding: the sampler and the plain decode loop (speculation replaces the loop's forward step later)."""

__all__: list[str] = []
