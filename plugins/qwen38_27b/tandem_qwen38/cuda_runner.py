"""``Qwen38CudaRunner``: the Qwen3.8 runner on a CUDA device, over ``tandem_qwen38.cuda_graphs.CudaRunner``.

The same buffers' layout as the reference runner (``model.allocate_state``), with ``max_tree``
positions of slack past ``max_context`` in ``K`` and ``V`` (a verify writes node ``i``'s row at
``start + i``). Its verbs map onto the graph runner's:

    decode    the decode graph (the one-node tree, its state stored in place)
    verify    the verify graph of the smallest captured width that holds the tree (``spec.max_tree`` is
              the widest)
    commit    the graph runner's commit, keeping the path's rule rows (``PathRows``): the record
              ``replay`` redoes when the engine takes pending tokens back
    prefill   the eager chunked prefill (cuBLAS projections, the chunked gated delta rule, flash
              attention)

The graphs are captured when the runner is built. No per-layer capture and no taps (``spec.trace``
off, ``spec.hidden_layers`` empty).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from tandem_core.engine import (
    Capture, LogitRows, Manifest, MemoryPart, Rows, RunnerSpec, Step, TreeStep, source_files, tensor_bytes,
)
from tandem_core.state import View

from tandem_qwen38 import cuda_graphs
from tandem_qwen38.config import Qwen38Config
from tandem_qwen38.cuda_graphs import CudaRunner, PathRows, fuse_weights, runner_widths
from tandem_qwen38.model import allocate_state, runner_files
from tandem_qwen38.weights import Qwen38Weights

__all__ = ["Qwen38CudaRunner"]

_KERNELS = ("triton_matmul.py", "triton_fused.py", "triton_gdn.py", "triton_attention.py")


class Qwen38CudaRunner:
    """One sequence on a CUDA device, bf16 dense weights (fused once per ``weights``, shared by siblings)."""

    def __init__(self, cfg: Qwen38Config, weights: Qwen38Weights, *, max_context: int, prefill_chunk: int,
                 max_tree: int = 64) -> None:
        widths = runner_widths(max_tree)
        self.cfg, self.w = cfg, weights
        self.device = weights.device
        self._sections, self._views = allocate_state(cfg, self.device, weights.act_dtype,
                                                     int(max_context) + widths[-1])
        S, conv = self._sections["gdn.S"], self._sections["gdn.conv"]
        K, V = self._views["K"].tensor, self._views["V"].tensor
        self.run = CudaRunner(cfg, fuse_weights(weights, cfg), S, conv, K, V, max_context=int(K.shape[2]),
                              widths=widths, prefill_chunk=int(prefill_chunk))
        with torch.no_grad():
            self.run.capture()
        self.spec = RunnerSpec(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, max_context=int(max_context),
            max_tree=widths[-1], prefill_chunk=int(prefill_chunk), device=str(self.device), dtype=weights.dtype,
            graph_widths=tuple(self.run.widths))

    def buffers(self) -> tuple[dict[str, torch.Tensor], dict[str, View]]:
        """Sections ``gdn.S``, ``gdn.conv``; views ``K``, ``V`` (with the verify's slack)."""
        return self._sections, self._views

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, step: Step, *, logits: LogitRows,
                capture: Capture | None = None) -> Rows:
        run = self.run
        run.length = step.start
        hidden: list[torch.Tensor] = []
        out = run.prefill(ids, logits == "all", hidden)                       # fp32, new
        h = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        return Rows(h, None if logits == "none" else out, {})

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, step: Step, *, capture: Capture | None = None) -> Rows:
        run = self.run
        run.length = step.start
        logits = run.decode(int(ids[0])).float()                              # [1, V], a new tensor
        return Rows(run.h[:1], logits, {})

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, tree: TreeStep, *, capture: Capture | None = None) -> Rows:
        run = self.run
        run.length = tree.start
        logits = run.verify(ids.tolist(), tree.parents).float()              # [N, V], a new tensor
        return Rows(run.h[:tree.count], logits, {})

    @torch.no_grad()
    def commit(self, tree: TreeStep, path: Sequence[int]) -> PathRows | None:
        """K/V rows, conv tails and the state replayed along the path; returns the path's rule rows."""
        run = self.run
        run.length = tree.start
        return run.commit(list(path), keep=True)

    @torch.no_grad()
    def replay(self, kept: Sequence[PathRows], n: int) -> PathRows:
        rows = PathRows.cat(kept).head(n)
        self.run.replay(rows)
        return rows

    def tap(self, layers: tuple[int, ...]) -> None:
        if layers:
            raise ValueError(f"Qwen38CudaRunner keeps no per-layer rows; cannot tap {list(layers)}")

    def reset(self) -> None:
        self.run.reset()

    def manifest(self) -> Manifest:
        """The reference's files, the graph runner's and its kernels', the widths and the matmul plans."""
        from tandem_core.ops import triton_matmul

        kernels = Path(next(iter(source_files(triton_matmul))))
        files = runner_files(self.w) | source_files(cuda_graphs, Qwen38CudaRunner)
        files |= {str(kernels.with_name(n)) for n in _KERNELS}
        settings = {"dtype": self.w.dtype, "device": self.device.type, "path": "cuda_graphs",
                    "widths": list(self.run.widths),
                    "matmul_plans": {f"{n}x{k}": asdict(p) for (n, k), p in sorted(self.run.plans.items())}}
        extra = {"arch": "qwen3_5", "weights": self.w.identity, "config": asdict(self.cfg)}
        return Manifest(tuple(sorted(files)), settings, extra)

    def memory_parts(self) -> list[MemoryPart]:
        dev = str(self.device)
        K, V = self._views["K"].tensor, self._views["V"].tensor
        return [
            MemoryPart("weights", self.w.nbytes, dev),
            MemoryPart("gdn.S", tensor_bytes(self._sections["gdn.S"]), dev),
            MemoryPart("gdn.conv", tensor_bytes(self._sections["gdn.conv"]), dev),
            MemoryPart("kv", tensor_bytes(K, V), dev),
            MemoryPart("cuda.workspace", self.run.workspace_bytes(), dev),
        ]

    def __repr__(self) -> str:
        return (f"Qwen38CudaRunner({self.cfg.num_hidden_layers} layers, {self.w.dtype}, {self.device}, "
                f"widths {self.run.widths[0]}..{self.run.widths[-1]})")
