"""Decoding: the sampler, the plain decode loop and lossless speculation (drafters' trees, StairCut, the walk)."""

__all__: list[str] = []
