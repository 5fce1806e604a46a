"""Constrained decoding through llguidance: JSON output and forced tool calls as grammars.

``Grammars(tokenizer, stop_ids)`` builds llguidance's tokenizer once (lazily, from the
tokenizer's ``tokenizer.json``) and compiles Lark grammars into ``GrammarConstraint``s,
which the decode loop asks for a mask before each draw.

- ``response_format`` json_object / json_schema: ``json_grammar(schema, think, budget)``.
- ``tool_choice`` "required" or a named function: ``tool_grammar(tools, fmt, think, parallel, budget)``,
  in the model's own tool-call format (``tandem_core.server.toolformat``).

Both are bounded by the request's ``max_tokens`` (``budget``): the free parts (strings, arrays,
numbers, the reasoning block, whitespace, the number of calls) get limits such that the
longest answer the grammar admits, in UTF-8 bytes and so in tokens, fits the budget
(``tandem_core.server.bounds``). A weak model's answer is then complete and valid when the
budget runs out, however it spends it; ``GrammarConstraint.done`` ends the answer as soon as
only a stop could follow.

``think`` says how a reasoning block precedes the constrained part: ``"none"`` (no
thinking), ``"open"`` (the prompt opened the block: free text up to its closing tag), or
``"maybe"`` (the answer may start with a block); the tags are the model's (``think_tags``,
``<think>`` and ``</think>`` unless its plugin says otherwise). The constrained part
starts after it, so thinking stays free.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from tandem_core.server.bounds import BoundError, choose, json_rule, raw_string_bytes, tighten, worst_bytes
from tandem_core.server.parsing.reasoning import THINK_TAGS
from tandem_core.server.toolformat import UnknownToolFormat, tool_format
from tandem_core.serving import Tokenizer

__all__ = ["GrammarError", "Grammars", "GrammarConstraint", "available", "MAX_CALLS"]

UNBOUNDED = 1 << 24     # a budget no answer reaches: no bound beyond the ladder's most generous rung
MAX_CALLS = 8           # the most calls one forced answer holds (with parallel_tool_calls)
WS_RULE = "ws: /[ \\t\\r\\n]{0,2}/"   # the format's whitespace between parts: at most 2 bytes
WS_BYTES = 2


class GrammarError(ValueError):
    """A schema or tool list llguidance cannot compile, or a tokenizer it cannot read."""


@runtime_checkable
class HasTokenizerJson(Protocol):
    """A tokenizer that can write itself as a Hugging Face ``tokenizer.json`` (llguidance builds its own from
    that text): the capability constrained decoding needs. ``tandem_core.tokenizer.HFTokenizer`` has it; a
    plugin's own tokenizer has it by defining ``to_json``."""

    def to_json(self) -> str: ...


def available(tokenizer: Tokenizer) -> bool:
    """Whether constrained decoding can run for this tokenizer (it can write its ``tokenizer.json``)."""
    return isinstance(tokenizer, HasTokenizerJson)


class GrammarConstraint:
    """One request's grammar state (the loop's ``Constraint``).

    ``done()`` is True once the grammar admits nothing but a stop: when the matcher stopped, or when
    the only tokens it still allows are stop tokens (the answer is complete; the loop ends it there
    instead of waiting for the model to pick the stop). It computes the next mask to tell, and
    ``allowed`` hands that same mask out: one mask a step either way.
    """

    def __init__(self, matcher: Any, n_vocab: int, stop_ids: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.stop_ids = [i for i in stop_ids if 0 <= i < n_vocab]
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._mask: torch.Tensor | None = None   # bool [n_vocab] for the next token, when computed

    def _next(self) -> torch.Tensor:
        if self._mask is None:
            words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(n/32)]
            bits = ((words.unsqueeze(-1) >> self._shifts) & 1).reshape(-1).bool()  # [32 * words]
            self._mask = bits[: self.n_vocab]
        return self._mask

    def allowed(self, vocab: int) -> torch.Tensor:
        """bool ``[vocab]``: True where the grammar allows the token (ids past the tokenizer's are never allowed)."""
        bits = self._next()
        out = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, bits.numel())
        out[:n] = bits[:n]
        return out

    def advance(self, token: int) -> None:
        self._mask = None
        if not self.matcher.consume_token(token):
            raise GrammarError(f"grammar refused token {token}: {self.matcher.get_error()}")

    def done(self) -> bool:
        if self.matcher.is_stopped():
            return True
        if not self.matcher.is_accepting():
            return False
        bits = self._next().clone()
        bits[self.stop_ids] = False
        return not bool(bits.any())


class Grammars:
    """Compiles grammars for one tokenizer. Thread-safe; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Sequence[int],
                 think_tags: tuple[str, str] = THINK_TAGS) -> None:
        self.tokenizer = tokenizer
        self.think_tags = think_tags
        self.stop_ids = list(dict.fromkeys([*stop_ids, *tokenizer.eos_token_ids]))
        self._lt: Any = None
        self._lock = threading.Lock()

    def lltokenizer(self) -> Any:
        with self._lock:
            if self._lt is None:
                import llguidance

                if not available(self.tokenizer):
                    raise GrammarError("constrained decoding needs a tokenizer.json tokenizer; this model's "
                                       "tokenizer is not one")
                tok = self.tokenizer
                assert isinstance(tok, HasTokenizerJson)
                try:
                    self._lt = llguidance.LLTokenizer(tok.to_json(), eos_token=self.stop_ids or None)
                except Exception as exc:  # llguidance cannot read every tokenizer.json (a WordLevel one)
                    self._lt = GrammarError(f"constrained decoding cannot read this model's tokenizer: {exc}")
            if isinstance(self._lt, GrammarError):
                raise self._lt
            return self._lt

    def constraint(self, lark: str) -> GrammarConstraint:
        import llguidance

        lt = self.lltokenizer()
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except Exception as exc:
            raise GrammarError(f"grammar: {exc}") from exc
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return GrammarConstraint(m, lt.vocab_size, self.stop_ids)

    # -- grammars -------------------------------------------------------------------------------------

    def literal(self, text: str) -> str:
        """``text`` in Lark: the special token by id when the tokenizer has it as one, else a string."""
        tid = self.tokenizer.token_to_id(text)
        if tid is not None and self.lltokenizer().is_special_token(tid):
            return f"<[{tid}]>"
        return json.dumps(text, ensure_ascii=False)

    def think_rules(self, think: str, chars: int = UNBOUNDED) -> tuple[str, list[str], int]:
        """(the start rule's prefix, extra rules, its most bytes) for a reasoning block of at most ``chars``
        characters before the constrained part (``chars`` 0: the block must close at once)."""
        if think == "none":
            return "", [], 0
        open_, close = self.literal(self.think_tags[0]), self.literal(self.think_tags[1])
        span = "*" if chars >= UNBOUNDED else f"{{0,{max(0, chars)}}}"
        # a special token never occurs inside text, so the body can be greedy before one
        body = f"THINK_BODY: /(?s:.{span})/" if close.startswith("<[") else \
            f"think_body[suffix={close}]: /(?s:.{span})/"
        block = f"THINK_BODY {close}" if close.startswith("<[") else "think_body"
        size = len("".join(self.think_tags).encode()) + raw_string_bytes(min(chars, UNBOUNDED)) + WS_BYTES
        if think == "open":
            return f"{block} ws ", [body], size
        return f"({open_} {block})? ws ", [body], size

    def json_grammar(self, schema: Mapping[str, Any] | None, think: str = "none", budget: int | None = None) -> str:
        """Lark for a JSON value: any object when ``schema`` is None (json_object), else the schema's; bounded
        (``tandem_core.server.bounds``) so that it closes within ``budget`` tokens (None: no budget)."""
        schema = {"type": "object"} if schema is None else dict(schema)
        avail = (UNBOUNDED if budget is None else budget) - 1           # the stop token
        target = avail if think == "none" else avail // 2
        try:
            bounds, size = choose(lambda b: worst_bytes(tighten(schema, b)), target)
            bounded = tighten(schema, bounds)
        except BoundError as exc:
            raise GrammarError(str(exc)) from exc
        prefix, rules, _ = self.think_rules(think, self._think_chars(think, avail - size))
        return "\n".join([
            f"start: {prefix}answer",
            "answer: " + json_rule(bounded),
            WS_RULE,
            *rules,
        ])

    def _think_chars(self, think: str, left: int) -> int:
        if think == "none":
            return 0
        return max(0, left - len("".join(self.think_tags).encode()) - WS_BYTES) // 4

    def tool_grammar(self, tools: Sequence[Mapping[str, Any]], fmt: str, think: str = "none",
                     parallel: bool = True, budget: int | None = None) -> str:
        """Lark for one or more calls of ``tools`` (OpenAI function tools) in the model's format, bounded so
        that the calls close within ``budget`` tokens (None: no budget): the arguments' free parts by the
        most generous ``LADDER`` rung that fits, at most ``MAX_CALLS`` calls (one without ``parallel``)."""
        if not tools:
            raise GrammarError("tool_choice asks for a tool call but no tool is given")
        try:
            form = tool_format(fmt)
        except UnknownToolFormat as exc:
            raise GrammarError(str(exc)) from exc
        if form is None:
            raise GrammarError(f"tool_choice needs the model's tool-call format; {fmt!r} has none")
        avail = (UNBOUNDED if budget is None else budget) - 1           # the stop token
        target = avail if think == "none" else avail // 2
        try:
            bounds, size = choose(lambda b: form.call_rules(tools, self.literal, b)[1], target)
            lines, size = form.call_rules(tools, self.literal, bounds)
        except BoundError as exc:
            raise GrammarError(str(exc)) from exc
        n = 1 if not parallel else max(1, min(MAX_CALLS, target // (size + WS_BYTES)))
        calls = "call" + " (ws call" * (n - 1) + ")?" * (n - 1)
        prefix, rules, _ = self.think_rules(think, self._think_chars(think, avail - n * (size + WS_BYTES)))
        return "\n".join([f"start: {prefix}{calls}", WS_RULE, *rules, *lines])

