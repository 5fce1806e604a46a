"""Constrained decoding through llguidance: JSON output and forced tool calls as grammars.

``Grammars(tokenizer, stop_ids)`` builds llguidance's tokenizer once (lazily, from the
tokenizer's ``tokenizer.json``) and compiles Lark grammars into ``GrammarConstraint``s,
which the decode loop asks for a mask before each draw.

- ``response_format`` json_object / json_schema: ``json_grammar(schema, think)``.
- ``tool_choice`` "required" or a named function: ``tool_grammar(tools, fmt, think, parallel)``,
  in the model's own tool-call format (``hermes_json`` or ``qwen_xml``).

``think`` says how a reasoning block precedes the constrained part: ``"none"`` (no
thinking), ``"open"`` (the prompt opened ``<think>``: free text up to ``</think>``), or
``"maybe"`` (the answer may start with a ``<think>`` block). The constrained part
starts after it, so thinking stays free.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping, Sequence

import torch

from tandem_core.serving import Tokenizer

__all__ = ["GrammarError", "Grammars", "GrammarConstraint", "available"]


class GrammarError(ValueError):
    """A schema or tool list llguidance cannot compile, or a tokenizer it cannot read."""


def available(tokenizer: Tokenizer) -> bool:
    """Whether constrained decoding can run for this tokenizer (it must be a ``tokenizer.json`` one)."""
    from tandem_core.tokenizer import HFTokenizer

    return isinstance(tokenizer, HFTokenizer)


class GrammarConstraint:
    """One request's grammar state (the loop's ``Constraint``)."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self, vocab: int) -> torch.Tensor:
        """bool ``[vocab]``: True where the grammar allows the token (ids past the tokenizer's are never allowed)."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(n/32)]
        bits = ((words.unsqueeze(-1) >> self._shifts) & 1).reshape(-1).bool()  # [32 * words]
        out = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, self.n_vocab, bits.numel())
        out[:n] = bits[:n]
        return out

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"grammar refused token {token}: {self.matcher.get_error()}")

    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


class Grammars:
    """Compiles grammars for one tokenizer. Thread-safe; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
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
                self._lt = llguidance.LLTokenizer(self.tokenizer.to_json(),  # type: ignore[attr-defined]
                                                  eos_token=self.stop_ids or None)
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
        return GrammarConstraint(m, lt.vocab_size)

    # -- grammars -------------------------------------------------------------------------------------

    def literal(self, text: str) -> str:
        """``text`` in Lark: the special token by id when the tokenizer has it as one, else a string."""
        tid = self.tokenizer.token_to_id(text)
        if tid is not None and self.lltokenizer().is_special_token(tid):
            return f"<[{tid}]>"
        return json.dumps(text, ensure_ascii=False)

    def think_rules(self, think: str) -> tuple[str, list[str]]:
        """(the start rule's prefix, extra rules) for a reasoning block before the constrained part."""
        if think == "none":
            return "", []
        open_, close = self.literal("<think>"), self.literal("</think>")
        # a special token never occurs inside text, so the body can be greedy before one
        body = 'THINK_BODY: /(?s:.*)/' if close.startswith("<[") else \
            'think_body[suffix=' + close + ']: /(?s:.*)/'
        block = f"THINK_BODY {close}" if close.startswith("<[") else "think_body"
        if think == "open":
            return f"{block} ws ", [body]
        return f"({open_} {block})? ws ", [body]

    def json_grammar(self, schema: Mapping[str, Any] | None, think: str = "none") -> str:
        """Lark for a JSON value: any object when ``schema`` is None (json_object), else the schema's."""
        schema = {"type": "object"} if schema is None else dict(schema)
        prefix, rules = self.think_rules(think)
        return "\n".join([
            f"start: {prefix}answer",
            "answer: %json " + json.dumps(schema, ensure_ascii=False),
            "ws: /[ \\t\\r\\n]*/",
            *rules,
        ])

    def tool_grammar(self, tools: Sequence[Mapping[str, Any]], fmt: str, think: str = "none",
                     parallel: bool = True) -> str:
        """Lark for one or more calls of ``tools`` (OpenAI function tools) in the model's format."""
        if not tools:
            raise GrammarError("tool_choice asks for a tool call but no tool is given")
        prefix, rules = self.think_rules(think)
        open_, close = self.literal("<tool_call>"), self.literal("</tool_call>")
        calls = "call (ws call)*" if parallel else "call"
        lines = [f"start: {prefix}{calls}", "ws: /[ \\t\\r\\n]*/", *rules]
        if fmt == "hermes_json":
            variants = []
            for t in tools:
                fn = t["function"]
                variants.append({"type": "object", "properties": {
                    "name": {"const": fn["name"]},
                    "arguments": fn.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False})
            body = variants[0] if len(variants) == 1 else {"anyOf": variants}
            lines += [f"call: {open_} ws body ws {close}",
                      "body: %json " + json.dumps(body, ensure_ascii=False)]
        elif fmt == "qwen_xml":
            names = []
            for i, t in enumerate(tools):
                fn = t["function"]
                params = (fn.get("parameters") or {}).get("properties") or {}
                pnames = []
                for j, (pname, pschema) in enumerate(params.items()):
                    pnames.append(f"p{i}_{j}")
                    lines.append(f"p{i}_{j}: " + json.dumps(f"<parameter={pname}>\n", ensure_ascii=False)
                                 + f" v{i}_{j} \"\\n\"")
                    lines.extend(_xml_value(f"v{i}_{j}", pschema))
                params_rule = f"(({' | '.join(pnames)}))*" if pnames else ""
                names.append(f"f{i}")
                lines.append(f"f{i}: " + json.dumps(f"<function={fn['name']}>\n", ensure_ascii=False)
                             + f" {params_rule} \"</function>\"")
            lines.append(f"call: {open_} ws ({' | '.join(names)}) ws {close}")
        else:
            raise GrammarError(f"tool_choice needs the model's tool-call format; {fmt!r} has none")
        return "\n".join(lines)


def _xml_value(rule: str, schema: Any) -> list[str]:
    """A parameter's value, typed by its JSON schema, then ``\\n</parameter>``."""
    end = json.dumps("\n</parameter>")
    t = schema.get("type") if isinstance(schema, Mapping) else None
    if t == "integer":
        return [f"{rule}: /-?[0-9]+/ {end}"]
    if t == "number":
        return [f"{rule}: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/ {end}"]
    if t == "boolean":
        return [f"{rule}: (\"true\" | \"false\") {end}"]
    if t in ("object", "array"):
        return [f"{rule}: %json {json.dumps(schema, ensure_ascii=False)} {end}"]
    return [f"{rule}[suffix={end}]: /(?s:.*)/"]
