"""A test model family for the conductor: the replay engine (``tests/plugins/replay_plugin``) with continuations.

A script may carry ``"then": {marker: text}``: when the tokens the engine is given stop following
the script (the conductor put hidden text in) and the text generated since the prompt then ends
with ``marker``, the script goes on with ``text`` from there. So a test chooses what the model
"writes" after the monitor closed a reasoning block, continued an empty turn, and so on.

``write_script_model(d, scripts)`` writes the directory (the replay tokenizer and template).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from replay_plugin import ReplayEngine, read_config
from replay_server import write_model

from tandem_core.plugins import hookimpl
from tandem_core.registry import Arch


@hookimpl
def tandem_architectures(register):
    register(Arch("script_test", ("ScriptForTest",), ("script_test",), "script_plugin:read_config",
                  "tandem-conductor-test", "script_plugin:serve"))


def write_script_model(d: Path, scripts: list[dict[str, Any]], default: str = "Hello there!") -> Path:
    write_model(d, scripts, default)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["ScriptForTest"], model_type="script_test")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


class ScriptEngine(ReplayEngine):
    def forward(self, tokens: Any, *, all_logits: bool = False) -> Any:
        import torch

        ids = [int(t) for t in torch.as_tensor(tokens).reshape(-1)]
        if self.kv.length == 0:
            return super().forward(tokens, all_logits=all_logits)
        n0 = self.kv.length
        script = self._script or {}
        k0 = n0 - self._prompt_len
        target = self._target
        diverged = not script.get("random") and any(
            ids[i] != (target[k0 + i] if k0 + i < len(target) else self.end) for i in range(len(ids)))
        delay = float(script.get("delay_s", 0.0))
        if delay:
            time.sleep(delay)
        if n0 + len(ids) > self.caps.max_context:
            raise ValueError(f"context full: {n0 + len(ids)} > {self.caps.max_context}")
        self._rows[n0:n0 + len(ids), 0] = torch.tensor(ids, dtype=torch.float32)
        self.kv.length = n0 + len(ids)
        self._live.length = self.kv.length
        self.forwards += 1
        if diverged:
            done = [int(v) for v in self._rows[self._prompt_len:self.kv.length, 0].tolist()]
            text = self.tok.decode(done)
            for marker, more in (script.get("then") or {}).items():
                if text.endswith(marker):
                    k = self.kv.length - self._prompt_len
                    self._target = [0] * k + self.tok.encode(more)
                    break
        rows = [self._row(n0 + i + 1) for i in range(len(ids))] if all_logits else [self._row(self.kv.length)]
        return torch.stack(rows)


def serve(args: Any, ctx: Any) -> Any:
    from tandem_core.serving import Served
    from tandem_core.tokenizer import HFTokenizer, load_chat_template

    d = Path(args.path)
    config = read_config(json.loads((d / "config.json").read_text()))
    ctx.mark("weights")
    tok = HFTokenizer.from_dir(d)
    ctx.mark("tokenizer")
    max_context = min(int(config.get("max_context", 512)), args.max_context)
    eng = ScriptEngine(config, tok, max_context)
    ctx.mark("engine")
    return Served(args.model_id, eng, tok, chat_template=load_chat_template(d) or "",
                  tool_format=config.get("tool_format", "hermes_json"), reasoning=bool(config.get("reasoning")),
                  stop_ids=tok.eos_token_ids, info={"weights": str(d), "fingerprints": {"script": "test"}},
                  spawn=lambda: ScriptEngine(config, tok, max_context))
