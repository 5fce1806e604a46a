"""Test helpers: a byte-level BPE tokenizer, a replay model directory, and a real ``tandem serve`` process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, not special (as in Qwen's tokenizer)

CORPUS = [
    "Hello there! The weather in Paris is sunny today, and tomorrow it will rain.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    "def add(x, y):\n    return x + y\n",
    "I think the answer is 42. Let me check the weather first.",
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
    "system user assistant tool You are a helpful assistant. Tools get_weather city days",
]

# ChatML with Hermes-style tools and Qwen3-style thinking switch.
CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}{% continue %}{% endif %}
<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def build_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return tok


def write_model(d: Path, scripts: list[dict[str, Any]], default: str = "Hello there!", *,
                tool_format: str = "hermes_json", reasoning: bool = True, max_context: int = 512,
                no_spawn: bool = False) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["ReplayForTest"], "model_type": "replay_test", "max_context": max_context,
        "tool_format": tool_format, "reasoning": reasoning, "scripts": scripts, "default": default,
        "no_spawn": no_spawn}))
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(*paths: Path | str, **env: str) -> dict[str, str]:
    """The environment of a process a test starts: this one's, ``paths`` ahead on its ``PYTHONPATH``, then
    ``env``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")]),
            **env}


class Server:
    """A ``tandem serve`` subprocess on a free loopback port; its stderr is kept for the tests to read."""

    def __init__(self, model_dir: Path, home: Path, *args: str, env: dict[str, str] | None = None,
                 model: str = "replay-test", paths: Sequence[Path | str] = ()) -> None:
        self.port = free_port()
        self.ledger = home / "ledger.sqlite"
        self.env = child_env(*paths, PLUGINS, ROOT, **{"TANDEM_EXTRA_PLUGINS": "replay_plugin",
                                                       "TANDEM_HOME": str(home), "TANDEM_DISABLE_ENTRYPOINTS": "1",
                                                       **(env or {})})
        self.cmd = [sys.executable, "-m", "tandem_core.cli.main", "serve", "--weights", str(model_dir),
                    "--model", model, "--port", str(self.port), "--ledger", str(self.ledger), *args]
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=str(ROOT))
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr), daemon=True)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("serving" in line and str(self.port) in line for line in self.stdout):
                return self
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise RuntimeError(f"tandem serve exited {self.proc.returncode}:\n{''.join(self.stderr)}")
            time.sleep(0.05)
        raise TimeoutError(f"tandem serve not ready after {timeout}s:\n{''.join(self.stderr)}")

    def log_text(self) -> str:
        return "".join(self.stderr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
