"""A test model family, registered through the hook like any model: an engine that replays scripts.

config.json (written by ``replay_server.write_model``)::

    {"architectures": ["ReplayForTest"], "model_type": "replay_test", "max_context": 512,
     "tool_format": "hermes_json", "reasoning": true,
     "scripts": [{"when": "[[weather]]", "text": "<tool_call>...", "delay_s": 0.0},
                 {"when": "[[json]]", "random": true}, ...],
     "default": "Hello there.", "no_spawn": false}

The engine decodes its prompt once (at the first forward after ``reset``) and picks
the first script whose ``when`` marker the prompt contains (else ``default``). A
text script puts a peak on its next token at each position (then the end token);
a ``random`` script gives pseudo-random logits that depend on the position only,
so only constrained decoding can make them valid JSON. ``delay_s`` sleeps in each
forward (slow generations for queue and disconnect tests); ``endless`` keeps a random
script's end token from ever being drawn, so a slow generation cannot stop early by chance. ``no_spawn`` leaves ``Served.spawn`` None.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tandem_core.plugins import hookimpl
from tandem_core.registry import Arch


@hookimpl
def tandem_architectures(register):
    register(Arch("replay_test", ("ReplayForTest",), ("replay_test",), "replay_plugin:read_config",
                  "tandem-replay-test", "replay_plugin:serve"))


def read_config(raw: dict[str, Any]) -> dict[str, Any]:
    for key in ("scripts", "default"):
        if key not in raw:
            raise ValueError(f"config.json: {key} is required")
    return dict(raw)


class _KV:
    def __init__(self) -> None:
        self.length = 0


class ReplayEngine:
    def __init__(self, config: dict[str, Any], tokenizer: Any, max_context: int) -> None:
        import torch

        from tandem_core.engine import Capabilities
        from tandem_core.state import ModelState, View

        self.config = config
        self.tok = tokenizer
        self.vocab = tokenizer.vocab_size
        self.end = tokenizer.eos_token_ids[0]
        self.caps = Capabilities(max_context=max_context)
        self.kv = _KV()
        self._rows = torch.zeros(max_context, 1)
        self._live = ModelState({}, {"ids": View(self._rows, 0)}, 0)
        self._script: dict[str, Any] | None = None
        self._target: list[int] = []
        self._prompt_len = 0
        self.forwards = 0

    def _choose(self, prompt_ids: list[int]) -> None:
        text = self.tok.decode(prompt_ids)
        script = next((s for s in self.config["scripts"] if s["when"] in text), None)
        self._script = script or {"text": self.config["default"]}
        self._target = [] if self._script.get("random") else self.tok.encode(self._script["text"])
        self._prompt_len = len(prompt_ids)

    def _row(self, position: int) -> Any:
        """Logits for the token at ``position`` (absolute)."""
        import torch

        assert self._script is not None
        k = position - self._prompt_len
        if self._script.get("random"):
            g = torch.Generator().manual_seed(7919 * position + 17)
            row = torch.randn(self.vocab, generator=g) * 2.0
            if self._script.get("endless"):
                row[self.end] = -1e4
            return row
        row = torch.zeros(self.vocab)
        row[self._target[k] if k < len(self._target) else self.end] = 20.0
        row[(position * 31) % self.vocab] += 3.0  # a runner-up, so logprobs have alternatives
        return row

    def forward(self, tokens: Any, *, all_logits: bool = False) -> Any:
        import torch

        ids = [int(t) for t in torch.as_tensor(tokens).reshape(-1)]
        if self.kv.length == 0:
            self._choose(ids)
        delay = float((self._script or {}).get("delay_s", 0.0))
        if delay:
            time.sleep(delay)
        n0 = self.kv.length
        if n0 + len(ids) > self.caps.max_context:
            raise ValueError(f"context full: {n0 + len(ids)} > {self.caps.max_context}")
        self._rows[n0:n0 + len(ids), 0] = torch.tensor(ids, dtype=torch.float32)
        self.kv.length = n0 + len(ids)
        self._live.length = self.kv.length
        self.forwards += 1
        rows = [self._row(n0 + i + 1) for i in range(len(ids))] if all_logits else [self._row(self.kv.length)]
        return torch.stack(rows)

    def picks(self, logits: Any) -> Any:
        return logits.argmax(-1)

    def hidden_post_norm(self) -> Any:
        import torch

        return torch.zeros(1, 1)

    @property
    def state(self) -> Any:
        return self._live

    def reset(self) -> None:
        self.kv.length = 0
        self._live.length = 0
        self._script = None

    def manifest(self) -> Any:
        from tandem_core.engine import Manifest

        return Manifest(files=(__file__,))

    def memory_parts(self) -> list[Any]:
        from tandem_core.engine import MemoryPart

        return [MemoryPart("replay rows", self._rows.numel() * 4, "cpu")]


def serve(args: Any, ctx: Any) -> Any:
    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer, load_chat_template

    d = Path(args.path)
    config = read_config(json.loads((d / "config.json").read_text()))
    total = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    done = 0
    for f in sorted(d.iterdir()):
        if f.is_file():
            done += f.stat().st_size
            ctx.progress(done, total, "weights")
    ctx.mark("weights")
    tok = HFTokenizer.from_dir(d)
    ctx.mark("tokenizer")
    max_context = min(int(config.get("max_context", 512)), args.max_context)
    eng = ReplayEngine(config, tok, max_context)
    ctx.mark("engine")
    return Served(args.model_id, eng, tok, chat_template=load_chat_template(d) or "",
                  tool_format=config.get("tool_format", "hermes_json"), reasoning=bool(config.get("reasoning")),
                  stop_ids=tok.eos_token_ids, info={"weights": str(d), "fingerprints": {"replay": "test"}},
                  spawn=None if config.get("no_spawn") else (lambda: ReplayEngine(config, tok, max_context)))
