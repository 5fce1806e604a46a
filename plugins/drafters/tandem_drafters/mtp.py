"""The shared MTP drafter: a checkpoint's own multi-token-prediction head, chained, as a small tree.

A Qwen3.8 or Flash-Next checkpoint may ship an MTP head (``mtp.*``: vLLM's Qwen3-Next / Qwen3.5 MTP
design). Its row ``i`` reads the token after position ``i`` and the target's row at ``i`` and guesses the
token after that; a deeper step feeds its own output row and guess back one position on. The family
supplies the arithmetic (a ``tandem_core.engine.base.DraftHead``) and offers it through its engine
(``MTPEngine``: ``caps.mtp``, ``supports_mtp``); this drafter, the same for every family, keeps the
head's own KV rows true for the sequence and proposes:

    depth        chained head steps a round (``depth`` option, default 3)
    prime        a new sequence (``begin``): the rows of the common prefix with the last one are kept
    capture      after a forward or a commit (``accepted``, and the first round): the target's rows of the
                 appended tokens (``engine.appended_rows()``, from the forwards or the verify that computed
                 them: no extra target pass; a prompt's prefill chunks come as one) -> the head's rows for every position whose next token is
                 known; the last position's row waits for its next token
    launch       the round's pending token -> the last position's row (depth 1) and ``depth - 1`` chained
                 steps, each from the previous step's top token and output row
    read         the top two tokens and their probabilities at each depth, ``[depth, 2]``
    resume(n)    the head's rows past ``n`` are forgotten (they are recomputed when the target's rows for
                 them come again)
    views        the head's own KV rows (tensor, token axis), ``max_context`` positions, engine's device

The proposal is a chain of each depth's top token, with the second token as a sibling leaf wherever the
top one's probability is below ``branch_below`` (default 0.75): at most ``2 * depth`` nodes, each with
the head's probability given its parent's path (the cut weighs them). The head's rows past the sequence
(the deeper steps') are scratch: a later capture rewrites them.

The head's rows are the drafter's, not the engine's state: the caches neither save nor restore them.
Where the target never computed positions on this engine (a prefix restored from a cache tier this
engine's head did not see; a prompt run in chunks still reaches the head whole, and a prefix it saw in
an earlier turn stays), those rows keep what they held and the head attends to them as they are: its drafts get worse there, never the answer (the target decides
every token). On random weights a head's drafts are essentially never accepted: its worth can only be
measured on a trained checkpoint; ``tools/bench_mtp.py`` measures its cost a round.
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
        self._device = torch.device(eng.caps.device)
        self._chunk = max(1, int(eng.caps.prefill_chunk) or 512)
        self._tokens: list[int] = []            # the sequence as told (begin + accepted)
        self._valid = 0                         # the head's rows 0 .. valid - 1 are the sequence's
        self._last: torch.Tensor | None = None  # [1, D] the target's row at position valid, waiting
        self._draft: tuple[torch.Tensor, torch.Tensor] | None = None

    def requires(self) -> Requirements:
        return Requirements(mtp=True)

    def views(self) -> dict[str, tuple[torch.Tensor, int]]:
        return self.head.views()

    # -- the sequence -------------------------------------------------------------------------------
    def reset(self) -> None:
        self._tokens = []
        self._valid = 0
        self._last = None
        self._draft = None

    def resume(self, n: int) -> None:
        """Forget the head's rows (and a waiting target row) past ``n``."""
        if n < self._valid or (self._last is not None and n <= self._valid):
            self._last = None
        self._valid = min(self._valid, max(0, int(n)))

    def prime(self, prompt_ids: Sequence[int]) -> None:
        """A new sequence, exactly ``prompt_ids``: the rows whose inputs it shares with the last one stay."""
        prompt = [int(t) for t in prompt_ids]
        old = self._tokens
        cp = 0
        m = min(len(old), len(prompt))
        while cp < m and old[cp] == prompt[cp]:
            cp += 1
        self.resume(max(0, cp - 1))        # row i reads x_{i+1}: it stands while both sequences agree there
        self._tokens = prompt
        self._draft = None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        # runs beside the prefill (SpecDecode indexes the prompt in a thread): bookkeeping only, no tensors
        self.prime(prompt_ids)

    def accepted(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(int(t) for t in tokens)
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """Take the target's rows of the tokens the engine's last forward or commit appended: the head's row
        for every such position but the last, whose next token is not known yet (it waits)."""
        start, rows = self.engine.appended_rows()
        n = len(self._tokens)
        if self._last is not None and self._valid + 1 < n:
            # the waiting row's next token came (a round the drafter was not asked to propose for)
            ids = torch.tensor([self._tokens[self._valid + 1]], dtype=torch.long, device=self._device)
            self.head.run(ids, self._last, self._valid, logits=False)
            self._valid, self._last = self._valid + 1, None
        T = min(int(rows.shape[0]), n - start)
        if T <= 0 or start < 0:
            return
        if start > self._valid:
            # positions the head never saw on this engine: their rows stay as they are
            self._valid, self._last = start, None
        elif start < self._valid:
            self._valid, self._last = start, None
        end = start + T - 1               # the last appended position: its row waits for the next token
        at = self._valid
        while at < end:
            stop = min(end, at + self._chunk)
            ids = torch.tensor(self._tokens[at + 1:stop + 1], dtype=torch.long, device=self._device)
            self.head.run(ids, rows[at - start:stop - start], at, logits=False)
            at = stop
        self._valid = end
        self._last = rows[end - start:end - start + 1].clone()

    @torch.inference_mode()
    def launch(self, token: int, depth: int | None = None) -> bool:
        """The round's pending ``token`` (the one after the last captured position): depth 1 from the waiting
        row, then ``depth - 1`` chained steps (``depth``: this round's, at most the drafter's). False when no
        target row is waiting (nothing to draft from)."""
        if self._last is None:
            return False
        at, layers = self._valid, max(1, int(self.head.layers))
        tok = torch.tensor([int(token)], dtype=torch.long, device=self._device)
        hidden = self._last
        tokens, probs = [], []
        for k in range(self.depth if depth is None else max(1, min(self.depth, int(depth)))):
            if at + k >= self.head.max_context:
                break
            out = self.head.run(tok, hidden, at + k, layer=k % layers)
            assert out.logits is not None
            top = torch.softmax(out.logits[-1].float(), dim=-1).topk(2)
            tokens.append(top.indices)
            probs.append(top.values)
            tok, hidden = top.indices[:1], out.carry[-1:]
            if k == 0:                    # row `at` read the sequence's own token and row: it stands
                self._valid, self._last = at + 1, None
        if not tokens:
            return False
        self._draft = (torch.stack(tokens), torch.stack(probs))
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
        held = len(context_ids) - 1       # the engine holds all but the pending last token
        if held != len(self._tokens) or int(context_ids[held - 1]) != self._tokens[-1]:
            self.prime(context_ids[:held])
        if self._last is None or self._valid != held - 1:
            self.capture()                # the first round: the prefill's rows
        if self._valid != held - 1 or not self.launch(int(context_ids[-1]), depth=max_nodes):
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
