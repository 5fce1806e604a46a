"""The shared MTP drafter: a checkpoint's own multi-token-prediction head, chained, as a small tree.

A Qwen3.8 or Flash-Next checkpoint may ship an MTP head (``mtp.*``: vLLM's Qwen3-Next / Qwen3.5 MTP
design). Its row ``i`` reads the token after position ``i`` and the target's row at ``i`` and guesses the
token after that; a deeper step feeds its own output row and guess back one position on. The family
supplies the arithmetic (a ``tandem_core.engine.base.DraftHead``) and offers it through its engine
(``MTPEngine``: ``caps.mtp``, ``supports_mtp``).

The engine keeps the head's rows true for its sequence (every forward and commit appends them, from that
call's own target rows) and holds them in its state (``mtp.hidden`` a section, ``mtp.K`` / ``mtp.V`` views):
a prefix restored from any cache tier brings the head's rows with it, so the drafts after a restore are
those after a cold prefill. This drafter only proposes:

    depth        chained head steps a round (``depth`` option, default 3; a round's ``max_nodes`` caps it)
    launch       the round's pending token -> the head's row at the engine's last position (depth 1) and
                 ``depth - 1`` chained steps, each from the previous step's top token and output row
                 (``DraftHead.launch``: on CUDA one graph replay, nothing read back until ``read``)
    read         the top two tokens and their probabilities at each depth, ``[depth, 2]`` (the one host sync)

The proposal is a chain of each depth's top token, with the second token as a sibling leaf wherever the
top one's probability is below ``branch_below`` (default 0.75): at most ``2 * depth`` nodes, each with
the head's probability given its parent's path (the cut weighs them). On random weights a head's drafts
are essentially never accepted: its worth can only be measured on a trained checkpoint;
``tools/bench_mtp.py`` measures its cost a round.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from tandem_core.drafter import DrafterMismatch, Proposal, Requirements, TargetInfo
from tandem_core.engine import DraftHead, MTPEngine, supports_mtp

__all__ = ["MTPDrafter", "Draft"]


class Draft(NamedTuple):
    """One launch's guesses: ``tokens[k]`` / ``probs[k]`` the top two at depth ``k`` (the chain follows
    column 0), on the CPU."""

    tokens: torch.Tensor    # [depth, 2] int64
    probs: torch.Tensor     # [depth, 2] fp32


class MTPDrafter:
    """A ``tandem_core.drafter.Drafter`` over an engine's MTP head (``target.engine`` or ``engine=``)."""

    name = "mtp"

    def __init__(self, target: TargetInfo | None = None, *, engine: Any = None, depth: int = 3,
                 branch_below: float = 0.75) -> None:
        eng = engine if engine is not None else (target.engine if target is not None else None)
        who = f" {target.name!r}" if target is not None and target.name else ""
        if eng is None:
            raise DrafterMismatch(f"drafter 'mtp' cannot draft for target{who}: it needs the engine itself "
                                  f"(its MTP head), and none was given")
        if not supports_mtp(eng):
            raise DrafterMismatch(f"drafter 'mtp' cannot draft for target{who}: it needs an MTP head "
                                  f"(the target's checkpoint ships none, or its engine offers none: "
                                  f"caps.mtp is 0)")
        if int(depth) < 1:
            raise ValueError(f"mtp drafter: depth {depth} must be at least 1")
        if not 0.0 <= float(branch_below) <= 1.0:
            raise ValueError(f"mtp drafter: branch_below {branch_below} must be in [0, 1]")
        self.engine: MTPEngine = eng
        self.head: DraftHead = eng.mtp_head()
        self.depth = int(depth)
        self.branch_below = float(branch_below)
        self._draft: tuple[torch.Tensor, torch.Tensor] | None = None

    def requires(self) -> Requirements:
        return Requirements(mtp=True)

    # -- the sequence (the engine keeps the head's rows: nothing to follow here) ----------------------
    def reset(self) -> None:
        self._draft = None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._draft = None

    def accepted(self, tokens: Sequence[int]) -> None:
        self._draft = None

    @torch.inference_mode()
    def launch(self, token: int, depth: int | None = None) -> bool:
        """Draft from the engine's sequence with ``token`` pending: ``depth`` chained head steps (at most the
        drafter's, and what the head's rows hold past the sequence). False when the engine holds no token."""
        held = int(self.engine.kv.length)
        want = self.depth if depth is None else max(1, min(self.depth, int(depth)))
        want = min(want, self.head.max_context - held + 1)
        if held < 1 or want < 1:
            return False
        self._draft = self.head.launch(int(token), held - 1, want)
        return True

    def read(self) -> Draft:
        """The last launch's top two tokens and probabilities a depth (CPU tensors)."""
        if self._draft is None:
            raise RuntimeError("mtp drafter: read() before a launch")
        tokens, probs = self._draft
        return Draft(tokens.cpu(), probs.float().cpu())

    # -- proposing ----------------------------------------------------------------------------------
    def propose(self, context_ids: Sequence[int], max_nodes: int) -> Proposal:
        if max_nodes <= 0 or len(context_ids) < 2:
            return Proposal.empty(self.name)
        if int(self.engine.kv.length) != len(context_ids) - 1:
            return Proposal.empty(self.name)     # the engine holds all but the pending token, or this is not its sequence
        if not self.launch(int(context_ids[-1]), depth=max_nodes):
            return Proposal.empty(self.name)
        return self.tree(self.read(), max_nodes)

    def tree(self, draft: Draft, max_nodes: int) -> Proposal:
        """The chain of top tokens, the second token a sibling leaf where the top one is unsure."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        parent = -1
        for (t1, t2), (p1, p2) in zip(draft.tokens.tolist(), draft.probs.tolist()):
            if len(tokens) >= max_nodes:
                break
            tokens.append(int(t1))
            parents.append(parent)
            probs.append(min(1.0, max(0.0, float(p1))))
            here = len(tokens) - 1
            if p1 < self.branch_below and len(tokens) < max_nodes:
                tokens.append(int(t2))
                parents.append(parent)
                probs.append(min(1.0, max(0.0, float(p2))))
            parent = here
        return Proposal(tuple(tokens), tuple(parents), tuple(probs), self.name)
