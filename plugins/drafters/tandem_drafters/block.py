"""The block drafter: a few layers that denoise a block of mask positions in one forward (the DFlash design).

What it reads of the target (``requires()``): the residual rows after a few chosen layers (the runner's taps,
captured inside the forwards the loop runs anyway: the prefill, each decode step, each verify's accepted path),
the input embedding and the output head (``TargetParts``, shared and frozen), the vocabulary, the hidden size
and, for a drafter trained here, the tokenizer's fingerprint.

The model (``BlockModel``), for a sequence whose last committed token sits at position ``P - 1``::

    context  c_t = hidden_norm(fc([h_t^(l1); h_t^(l2); ...]))        t < P: the target's rows, projected
    block    x = embed([pending, mask, mask, ..., mask]) * scale       B positions P .. P + B - 1
    layer    x += attn(q = x, k/v = [c ; x])                           no causal mask: every block position
             x += mlp(x)                                               sees the context and the whole block
    out      logits_i = head(norm(x_i)) * multiplier                  i = 1 .. B - 1: the tokens after pending

Each layer has its own k/v projections of the context rows, computed once per row and kept (a cache that
grows with the sequence). The B - 1 distributions come from one forward; the proposal is a tree over their
top-k tokens (a node's probability is its position's probability of its token), best first on path
probability, so the cut can branch where the drafter is unsure.

The checkpoint is the published DFlash layout (``config.json`` + ``model.safetensors``: ``fc``,
``hidden_norm``, ``layers.N.{input_layernorm,post_attention_layernorm,self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm,mlp.{gate,up,down}_proj}``, ``norm``; ``dflash_config`` holds ``target_layer_ids``,
``mask_token_id`` and ``block_size``), so a drafter published for a model loads as it is; one trained here
adds a ``tandem`` key (the target's id and tokenizer fingerprint). ``read_config`` refuses what it cannot
run (a sliding-window or DFlash2 drafter, another activation), naming the file and the field.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from tandem_core.drafter import DrafterMismatch, Proposal, Requirements, TargetInfo, TargetParts
from tandem_drafters.block_model import (CONFIG_FILE, WEIGHTS_FILE, BlockConfig, BlockDrafterError, BlockModel,
                                         default_layers, fetch_published, find_checkpoint, load_checkpoint,
                                         read_config, save_checkpoint)

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "BlockConfig",
    "BlockDrafter",
    "BlockDrafterError",
    "BlockModel",
    "block_tree",
    "default_layers",
    "fetch_published",
    "find_checkpoint",
    "load_checkpoint",
    "read_config",
    "save_checkpoint",
]


# -- the tree over the block's distributions --------------------------------------------------------------


def block_tree(tokens: Sequence[Sequence[int]], probs: Sequence[Sequence[float]], max_nodes: int,
               source: str) -> Proposal:
    """A tree over per-position candidates: position ``d``'s ``tokens[d][j]`` (probability ``probs[d][j]``) may
    follow any node at depth ``d``; nodes best first on path probability (a child never before its parent),
    at most ``max_nodes``."""
    out_t: list[int] = []
    out_p: list[int] = []
    out_q: list[float] = []
    depth = len(tokens)
    if depth == 0 or max_nodes <= 0:
        return Proposal.empty(source)
    heap: list[tuple[float, int, int, int, int]] = []   # (-path prob, order, depth, candidate, parent node)
    order = 0
    for j, p in enumerate(probs[0]):
        heapq.heappush(heap, (-p, order, 0, j, -1))
        order += 1
    while heap and len(out_t) < max_nodes:
        neg, _, d, j, par = heapq.heappop(heap)
        node = len(out_t)
        out_t.append(int(tokens[d][j]))
        out_p.append(par)
        out_q.append(min(1.0, max(0.0, float(probs[d][j]))))
        if d + 1 < depth:
            for jj, p in enumerate(probs[d + 1]):
                heapq.heappush(heap, (neg * p, order, d + 1, jj, node))
                order += 1
    return Proposal(tuple(out_t), tuple(out_p), tuple(out_q), source)


# -- the drafter ----------------------------------------------------------------------------------------------


class BlockDrafter:
    """The block drafter for one sequence at a time (``Drafter`` and ``ReadsHidden``).

    Options: ``path`` (a checkpoint folder; default ``find_checkpoint(target)``), ``top_k`` (candidates a
    position, 4), ``min_prob`` (a candidate below it is dropped, 0.01), ``model`` (a ``BlockModel`` already
    built, for the trainer and the tests).
    """

    name = "block"
    costly = True      # its proposal is a forward: the loop pauses it while it misses (DrafterGate)

    def __init__(self, target: TargetInfo, path: str | Path | None = None, top_k: int = 4,
                 min_prob: float = 0.01, model: BlockModel | None = None) -> None:
        self.target = target
        self.parts: TargetParts | None = target.parts
        device = self.parts.device if self.parts is not None else "cpu"
        dtype = (self.parts.dtype if self.parts is not None and self.parts.dtype is not None else torch.float32)
        if model is None:
            where = Path(path).expanduser() if path else find_checkpoint(target)
            if where is None:
                who = f" {target.name!r}" if target.name else ""
                raise DrafterMismatch(f"drafter 'block' cannot draft for target{who}: it needs a checkpoint (none "
                                      "set in TANDEM_BLOCK_DRAFTER, none shipped in the model's registry entry; "
                                      "train one with `tandem train-drafter`)")
            model = load_checkpoint(where, device=device, dtype=dtype)
        self.model = model.eval()
        self.cfg = model.cfg
        self.top_k = max(1, int(top_k))
        self.min_prob = float(min_prob)
        self.layers = tuple(self.cfg.target_layer_ids)
        self._kbuf: list[torch.Tensor] = []     # each layer's context keys / values, [nkv, capacity, hd]
        self._vbuf: list[torch.Tensor] = []
        self._pos: list[int] = []        # position of each held row (increasing)
        self._toks: list[int] = []       # token of each held row
        self._check = True               # compare the held tokens with the next context before using them
        self.reset()

    def requires(self) -> Requirements:
        c = self.cfg
        # a drafter trained here names the tokenizer and the vocabulary it saw (the tokenizer's, as TargetInfo
        # counts it); a published one names neither (its vocab_size is the embedding's rows, which a tokenizer
        # may count differently): its hidden size and layers must fit
        return Requirements(hidden_layers=self.layers, embedding=True, head=True, tokenizer=c.tokenizer,
                            vocab_size=c.extra.get("target_vocab_size") if c.tokenizer else None,
                            hidden_size=c.hidden_size)

    # -- the sequence ---------------------------------------------------------------------------------
    def reset(self) -> None:
        self._kbuf = []
        self._vbuf = []
        self._pos, self._toks = [], []
        self._check = True

    @property
    def _k(self) -> list[torch.Tensor]:
        """Each layer's keys of the held context rows, ``[nkv, n, hd]`` (views of the growing buffers)."""
        return [k[:, :len(self._pos)] for k in self._kbuf]

    @property
    def _v(self) -> list[torch.Tensor]:
        return [v[:, :len(self._pos)] for v in self._vbuf]

    def _room(self, n: int, like: torch.Tensor) -> None:
        """Buffers that hold ``n`` rows (doubling, so appending a row a round costs no copy of the rest)."""
        cap = self._kbuf[0].shape[1] if self._kbuf else 0
        if n <= cap:
            return
        new = max(n, 2 * cap, 256)
        held = len(self._pos)
        c = self.cfg
        kb = [like.new_empty(c.num_kv_heads, new, c.head_dim) for _ in range(c.num_layers)]
        vb = [like.new_empty(c.num_kv_heads, new, c.head_dim) for _ in range(c.num_layers)]
        for i in range(len(self._kbuf)):
            kb[i][:, :held] = self._kbuf[i][:, :held]
            vb[i][:, :held] = self._vbuf[i][:, :held]
        self._kbuf, self._vbuf = kb, vb

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._check = True     # the rows held may belong to another sequence: checked at the next propose

    def accepted(self, tokens: Sequence[int]) -> None:
        """Nothing: the rows of accepted tokens come through ``hidden``."""

    def _truncate(self, n: int) -> None:
        if n < len(self._pos):
            del self._pos[n:], self._toks[n:]

    @torch.inference_mode()
    def hidden(self, start: int, tokens: Sequence[int], rows: Mapping[int, torch.Tensor]) -> None:
        T = len(tokens)
        if T == 0:
            return
        self._truncate(bisect.bisect_left(self._pos, start))
        p = next(self.model.parameters())
        feats = torch.cat([rows[i].to(p.device, p.dtype) for i in self.layers], dim=-1)  # [T, nL*H]
        if feats.shape[0] != T:
            raise ValueError(f"block drafter: {T} tokens but {feats.shape[0]} hidden rows")
        ctx = self.model.context(feats)
        pos = torch.arange(start, start + T)
        held = len(self._pos)
        self._room(held + T, ctx)
        for i, (k, v) in enumerate(self.model.context_kv(ctx, pos)):
            self._kbuf[i][:, held:held + T] = k
            self._vbuf[i][:, held:held + T] = v
        self._pos.extend(range(start, start + T))
        self._toks.extend(int(t) for t in tokens)

    def _sync(self, context: Sequence[int]) -> None:
        """Keep only the held rows whose token is the context's at that position (a new sequence shares a prefix
        with the last one at most)."""
        n = 0
        for n, (pos, tok) in enumerate(zip(self._pos, self._toks)):
            if pos >= len(context) or context[pos] != tok:
                break
        else:
            n = len(self._pos)
        self._truncate(n)
        self._check = False

    # -- the proposal ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, context_ids: Sequence[int], max_nodes: int) -> Proposal:
        if self.parts is None or not context_ids or max_nodes <= 0:
            return Proposal.empty(self.name)
        if self._check:
            self._sync(context_ids)
        P = len(context_ids) - 1           # the pending token's position: the block starts there
        self._truncate(bisect.bisect_left(self._pos, P))      # rows of the context only, never of pending
        if not self._pos:
            return Proposal.empty(self.name)
        c = self.cfg
        B = min(c.block_size, max_nodes + 1)
        ids = torch.full((B,), c.mask_token_id, dtype=torch.long)
        ids[0] = int(context_ids[-1])
        p = next(self.model.parameters())
        x = self.parts.embed(ids).to(p.device, p.dtype)
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        h = self.model.blocks(x, list(zip(self._k, self._v)), torch.arange(P, P + B))
        probs = torch.softmax(self.model.logits(h[1:], self.parts.head), dim=-1)    # [B - 1, V]
        top_p, top_t = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        toks, prbs = top_t.tolist(), top_p.tolist()
        keep_t: list[list[int]] = []
        keep_p: list[list[float]] = []
        for ts, ps in zip(toks, prbs):
            kt = [t for t, q in zip(ts, ps) if q >= self.min_prob] or ts[:1]
            keep_t.append(kt)
            keep_p.append(ps[:len(kt)])
        return block_tree(keep_t, keep_p, max_nodes, self.name)
