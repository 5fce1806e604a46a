"""A made-up third model family, registered the way any plugin is (tests/test_load_shared.py).

The toy "ToyForCausalLM": h_t = mean of the embeddings of tokens 0..t (a running sum kept as a
recurrent section, each token's embedding kept in a view), logits_t = h_t @ head^T. Its ``ToyRunner`` is a
runner like any family's: the core's sequence engine runs it, and it passes the runner conformance suite
(tests/test_runner_conformance.py) with no edit under tandem_core/.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem_core.plugins import hookimpl
from tandem_core.registry import Arch


@hookimpl
def tandem_architectures(register):
    register(Arch("toy", ("ToyForCausalLM",), ("toy",), "toy_model_plugin:read_config", "tandem-toy", "toy_model_plugin:serve"))


def read_config(raw):
    from tandem_core.checkpoint import FieldPolicy, read_strict

    return read_strict(raw, FieldPolicy(read={"vocab_size", "hidden_size"}, ignored={"architectures", "model_type"}))


class ToyRunner:
    """The toy's arithmetic as a ``Runner`` (the core's ``SequenceEngine`` runs the sequence over it): every row
    is ``(sum of its path's embeddings) / position`` with the same ops whatever the call, so verified rows are
    decode rows bit for bit."""

    def __init__(self, embed, head, max_context=256, max_tree=64):
        import torch

        from tandem_core.engine import RunnerSpec

        self.embed, self.head = embed, head
        self.spec = RunnerSpec(vocab_size=embed.shape[0], hidden_size=embed.shape[1], max_context=max_context,
                               max_tree=max_tree, prefill_chunk=max_context)
        self._rows = torch.zeros(max_context, embed.shape[1])
        self._sum = torch.zeros(embed.shape[1])
        self._tree = None

    def buffers(self):
        from tandem_core.state import View

        return {"sum": self._sum}, {"E": View(self._rows, 0)}

    def _append(self, t, start):
        import torch

        from tandem_core.engine import Rows

        e = self.embed[t]                                   # e: [T, H]
        self._rows[start:start + len(t)] = e
        csum = torch.stack([self._sum + e[:j + 1].sum(0) for j in range(len(t))])    # csum: [T, H]
        h = csum / torch.arange(start + 1, start + len(t) + 1).unsqueeze(1)
        self._sum.copy_(csum[-1])
        return Rows(h, self._logits(h), {})

    def _logits(self, h):
        """Row by row, each on a fresh copy: the same call for a row whatever the call's other rows."""
        import torch

        return torch.stack([self.head @ h[i].clone() for i in range(h.shape[0])])

    def prefill(self, ids, step, *, logits, capture=None):
        from tandem_core.engine import Rows

        rows = self._append(ids, step.start)
        return Rows(rows.hidden, {"all": rows.logits, "last": rows.logits[-1:], "none": None}[logits], {})

    def decode(self, ids, step, *, capture=None):
        return self._append(ids, step.start)

    def verify(self, ids, tree, *, capture=None):
        import torch

        from tandem_core.engine import Rows

        sums = []
        for tok, par in zip(ids.tolist(), tree.parents):
            sums.append((self._sum if par < 0 else sums[par]) + self.embed[tok:tok + 1].sum(0))
        h = torch.stack(sums) / (tree.positions() + 1).unsqueeze(1)
        self._tree = (ids.clone(), sums)
        return Rows(h, self._logits(h), {})

    def commit(self, tree, path):
        ids, sums = self._tree
        for j, i in enumerate(path):
            self._rows[tree.start + j] = self.embed[int(ids[i])]
        self._sum.copy_(sums[path[-1]])
        return ids[list(path)]

    def replay(self, kept, n):
        import torch

        toks = torch.cat(list(kept))[:n]
        for tok in toks.tolist():
            self._sum.copy_(self._sum + self.embed[tok:tok + 1].sum(0))
        return toks

    def tap(self, layers):
        assert not layers

    def reset(self):
        self._sum.zero_()

    def manifest(self):
        from tandem_core.engine import Manifest

        return Manifest(files=(__file__,))

    def memory_parts(self):
        from tandem_core.engine import MemoryPart

        return [MemoryPart("weights", self.embed.numel() * 4 + self.head.numel() * 4, "cpu")]


def toy_engine(embed, head, max_context=256, max_tree=64):
    from tandem_core.engine import SequenceEngine

    return SequenceEngine(ToyRunner(embed, head, max_context, max_tree), name="toy")


def serve(args, ctx):
    import torch
    from safetensors.torch import load_file

    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer

    d = Path(args.path)
    read_config(json.loads((d / "config.json").read_text()))
    w = load_file(str(d / "model.safetensors"))
    ctx.mark("weights")
    eng = toy_engine(w["embed"].to(torch.float32), w["head"].to(torch.float32), args.max_context)
    tok = HFTokenizer.from_file(d / "tokenizer.json", eos_tokens=["<eos>"])
    return Served(args.model_id, eng, tok, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
                  tool_format="none", stop_ids=tok.eos_token_ids, info={"weights": str(d)},
                  spawn=lambda: toy_engine(eng.runner.embed, eng.runner.head, args.max_context))
