"""A made-up third model family, registered the way any plugin is (tests/test_load_shared.py).

The toy "ToyForCausalLM": h_t = mean of the embeddings of tokens 0..t (a running sum kept as a
recurrent section, each token's embedding kept in a view), logits_t = h_t @ head^T.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem_core.plugins import hookimpl
from tandem_core.registry import Arch


@hookimpl
def tandem_architectures(register):
    register(Arch("toy", ("ToyForCausalLM",), ("toy",), "toy_model_plugin:read_config",
                  "toy_model_plugin:ToyEngine", "tandem-toy", "toy_model_plugin:serve"))


def read_config(raw):
    from tandem_core.checkpoint import FieldPolicy, read_strict

    return read_strict(raw, FieldPolicy(read={"vocab_size", "hidden_size"}, ignored={"architectures", "model_type"}))


class _KV:
    def __init__(self, state):
        self._state = state

    @property
    def length(self):
        return self._state.length


class ToyEngine:
    def __init__(self, embed, head, max_context=256):
        import torch

        from tandem_core.engine import Capabilities
        from tandem_core.state import ModelState, View

        self.embed, self.head = embed, head
        self.caps = Capabilities(recurrent=True, max_context=max_context)
        self._rows = torch.zeros(max_context, embed.shape[1])
        self._sum = torch.zeros(embed.shape[1])
        self._live = ModelState({"sum": self._sum}, {"E": View(self._rows, 0)}, 0)
        self.kv = _KV(self._live)
        self._hidden = None

    def forward(self, tokens, *, all_logits=False):
        import torch

        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n0 = self.kv.length
        e = self.embed[t]                                   # e: [T, H]
        self._rows[n0:n0 + len(t)] = e
        csum = self._sum + e.cumsum(0)                      # csum: [T, H]
        h = csum / torch.arange(n0 + 1, n0 + len(t) + 1).unsqueeze(1)
        self._sum.copy_(csum[-1])
        self._live.length = n0 + len(t)
        self._hidden = h
        logits = h @ self.head.T
        return logits if all_logits else logits[-1:]

    def picks(self, logits):
        return logits.argmax(-1)

    def hidden_post_norm(self):
        return self._hidden

    @property
    def state(self):
        return self._live

    def reset(self):
        self._sum.zero_()
        self._live.length = 0

    def cache_state(self):
        return self._live

    def manifest(self):
        from tandem_core.engine import Manifest

        return Manifest(files=(__file__,))

    def memory_parts(self):
        from tandem_core.engine import MemoryPart

        return [MemoryPart("weights", self.embed.numel() * 4 + self.head.numel() * 4, "cpu")]


def serve(args, ctx):
    import torch
    from safetensors.torch import load_file

    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer

    d = Path(args.path)
    read_config(json.loads((d / "config.json").read_text()))
    w = load_file(str(d / "model.safetensors"))
    ctx.mark("weights")
    eng = ToyEngine(w["embed"].to(torch.float32), w["head"].to(torch.float32), args.max_context)
    tok = HFTokenizer.from_file(d / "tokenizer.json", eos_tokens=["<eos>"])
    return Served(args.model_id, eng, tok, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
                  tool_format="none", stop_ids=tok.eos_token_ids, info={"weights": str(d)},
                  spawn=lambda: ToyEngine(eng.embed, eng.head, args.max_context))
