"""What a model plugin hands the server: ``serve(args, ctx) -> Served``.

An ``Arch``'s ``serve`` names a function that loads the weights, builds the
engine and the tokenizer, and returns a ``Served``. The server never imports a
model class and never asks which model it holds: everything model-specific
(chat template, tool-call format, reasoning tags, stop tokens) is in here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from tandem_core.engine import Engine

__all__ = ["Tokenizer", "Served", "ServeContext", "ServeArgs"]


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids, with the model's special tokens.

    ``encode`` never adds special tokens unless asked (the chat template writes
    them); ``decode`` of a partial sequence may end in an incomplete character
    (streaming detokenisation holds those back).
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def fingerprint(self) -> str:
        """sha256 of what defines the tokenizer (its vocabulary, merges and special tokens)."""
        ...


@dataclass
class ServeArgs:
    """What the server asks of a model plugin's ``serve``: where the weights are and how to hold them."""

    model_id: str
    path: Path
    device: str = "cpu"
    dtype: str = "fp32"
    max_context: int = 8192
    threads: int = 0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Served:
    """Everything the server needs for one model.

    engine         the engine (hot and cold verbs; its ``caps`` say the rest)
    tokenizer      the model's tokenizer
    chat_template  the model's own Jinja chat template (rendered sandboxed)
    tool_format    the name of a registered tool-call format (``tandem_tool_formats``: ``"hermes_json"``,
                   a plugin's ``"qwen_xml"``...) or ``"none"``: which parser and grammar read and force its calls
    reasoning      True when the model writes a reasoning block
    think_in_prompt True when the template opens the block in the prompt (the output starts inside it)
    think_tags     the block's opening and closing tags
    stop_ids       token ids that end a turn
    info           the record ``/health`` shows: weights, fingerprints, load stages, memory parts
    spawn          builds another engine sharing the weights (own buffers), for ``--parallel N``; None if
                   the model cannot
    """

    model_id: str
    engine: Engine
    tokenizer: Tokenizer
    chat_template: str
    tool_format: str = "hermes_json"
    reasoning: bool = False
    think_in_prompt: bool = False
    think_tags: tuple[str, str] = ("<think>", "</think>")
    stop_ids: tuple[int, ...] = ()
    template_vars: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    spawn: Callable[[], Engine] | None = None


def host_memory_kinds() -> dict[str, int]:
    """``anon``, ``file`` and ``peak`` resident bytes of this process (``/proc/self/status``; empty elsewhere)."""
    want = {"RssAnon:": "anon", "RssFile:": "file", "VmHWM:": "peak"}
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(maxsplit=1)[0] if line.strip() else ""
                if key in want:
                    out[want[key]] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def host_memory() -> tuple[int, int]:
    """``(resident bytes now, peak resident bytes)`` of this process. The peak is the kernel's high-water mark
    of this process's own memory (``VmHWM``); ``ru_maxrss`` is used only where ``/proc`` does not answer,
    because Linux carries the parent's high-water mark through fork and exec into it (a launcher that held
    gigabytes would show as this process's peak)."""
    import resource

    import psutil

    rss = int(psutil.Process().memory_info().rss)
    peak = host_memory_kinds().get("peak")
    if peak is None:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return rss, peak


class ServeContext:
    """Passed to ``serve``: ``mark(stage)`` writes the load ledger (with the host memory at that point, so a
    stage that holds a host copy of the weights shows), ``log(line)`` the log, ``progress(done, total, what)``
    drives the load progress bar."""

    def __init__(self, log: Callable[[str], None] | None = None,
                 progress: Callable[[int, int, str], None] | None = None) -> None:
        self._log = log or (lambda line: None)
        self._progress = progress or (lambda done, total, what: None)
        self.t0 = time.perf_counter()
        self.stages: list[tuple[str, float]] = []
        self.memory: list[tuple[str, int, int]] = []     # (stage, host rss, host peak rss)

    def mark(self, stage: str) -> None:
        t = time.perf_counter() - self.t0
        rss, peak = host_memory()
        self.stages.append((stage, round(t, 3)))
        self.memory.append((stage, rss, peak))
        self._log(f"load stage {stage} at {t:.2f}s (host rss {rss / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB)")

    def log(self, line: str) -> None:
        self._log(line)

    def progress(self, done: int, total: int, what: str = "weights") -> None:
        self._progress(done, total, what)
