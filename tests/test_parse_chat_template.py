"""The Qwen3.8 chat template fixture renders a multi-turn tool conversation in the Qwen3.5 format,
in jinja2's immutable sandbox, and the calls it writes in history parse back to the same calls."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem_core.server.parse import parse_complete, think_open_at_end

from qwen35_tokenizer import qwen35_tokenizer

TEMPLATE = Path(__file__).parent / "fixtures" / "qwen38_chat_template.jinja"

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file <utf-8>",
        "parameters": {"type": "object", "required": ["path"], "properties": {
            "path": {"type": "string", "description": "file path"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "required": ["command"], "properties": {
            "command": {"type": "string"}, "env": {"type": "object"}, "background": {"type": "boolean"}}}}},
]

CALL_A = {"path": "src/app.py", "limit": 40}
CALL_B = {"command": "grep -n 'def main' -r src/\nwc -l src/*.py", "env": {"LANG": "C", "DEPTH": 2},
          "background": False}

MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "Earlier question"},
    {"role": "assistant", "content": "Earlier answer.", "reasoning_content": "old thoughts"},
    {"role": "user", "content": [{"type": "text", "text": "Find main() in the repo"}]},
    {"role": "assistant", "content": "Let me look.", "reasoning_content": "Need the file first.",
     "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": CALL_A}},
         {"id": "call_2", "type": "function", "function": {"name": "bash", "arguments": CALL_B}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "def main():\n    run()"},
    {"role": "tool", "tool_call_id": "call_2", "content": "src/app.py:1:def main"},
    {"role": "assistant", "content": "<think>\nFound it.\n</think>\n\nIt is in src/app.py, line 1."},
]


def _raise(message: str) -> None:
    raise ValueError(message)


@pytest.fixture(scope="module")
def template():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string(TEMPLATE.read_text())


def _turns(prompt: str) -> list[tuple[str, str]]:
    """(role, body) of every complete ``<|im_start|>role\\nbody<|im_end|>`` turn."""
    return re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", prompt, flags=re.S)


def test_multi_turn_tool_conversation_structure(template) -> None:
    prompt = template.render(messages=MESSAGES, tools=TOOLS, add_generation_prompt=True)
    turns = _turns(prompt)
    assert [r for r, _ in turns] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert prompt.count("<|im_start|>") == 8 and prompt.count("<|im_end|>") == 7
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert think_open_at_end(prompt)

    system = turns[0][1]
    assert system.startswith("# Tools\n\n") and system.endswith("\n\nYou are a careful coding agent.")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, flags=re.S)
    assert listed is not None
    assert [json.loads(line) for line in listed.group(1).split("\n")] == TOOLS
    assert "<tool_call>\n<function=" in system and "<parameter=" in system

    # reasoning is kept only after the last real user query
    assert turns[2][1] == "Earlier answer."
    assert turns[3][1] == "Find main() in the repo"
    first = turns[4][1]
    assert first.startswith("<think>\nNeed the file first.\n</think>\n\nLet me look.\n\n<tool_call>\n")
    assert "old thoughts" not in prompt
    assert turns[6][1] == "<think>\nFound it.\n</think>\n\nIt is in src/app.py, line 1."

    # both tool results in one user turn, in order
    assert turns[5][1] == ("<tool_response>\ndef main():\n    run()\n</tool_response>"
                           "\n<tool_response>\nsrc/app.py:1:def main\n</tool_response>")


def test_history_calls_parse_back_with_their_types(template) -> None:
    prompt = template.render(messages=MESSAGES, tools=TOOLS, add_generation_prompt=False)
    body = _turns(prompt)[4][1]
    assert body.count("<tool_call>") == 2 and "<parameter=limit>\n40\n</parameter>" in body
    parsed = parse_complete(body, "qwen_xml", True, False, TOOLS)
    assert parsed.reasoning == "Need the file first."
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("read_file", CALL_A),
                                                                              ("bash", CALL_B)]


def test_enable_thinking_false_closes_the_block(template) -> None:
    prompt = template.render(messages=MESSAGES[3:4], add_generation_prompt=True, enable_thinking=False)
    assert prompt == ("<|im_start|>user\nFind main() in the repo<|im_end|>\n"
                      "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not think_open_at_end(prompt)


def test_no_tools_plain_system(template) -> None:
    prompt = template.render(messages=MESSAGES[:2], add_generation_prompt=False)
    assert prompt == ("<|im_start|>system\nYou are a careful coding agent.<|im_end|>\n"
                      "<|im_start|>user\nEarlier question<|im_end|>\n")


def test_template_refuses_bad_conversations(template) -> None:
    with pytest.raises(ValueError, match="no user query"):
        template.render(messages=[{"role": "system", "content": "s"}])
    with pytest.raises(ValueError, match="system message must come first"):
        template.render(messages=[{"role": "user", "content": "u"}, {"role": "system", "content": "s"}])
    with pytest.raises(ValueError, match="must be a mapping"):
        call = {"type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
        template.render(messages=[{"role": "user", "content": "u"},
                                  {"role": "assistant", "content": "", "tool_calls": [call]}])


def test_sandbox_holds(template) -> None:
    env = ImmutableSandboxedEnvironment()
    with pytest.raises(SecurityError):
        env.from_string("{{ messages.append(1) }}").render(messages=[])
    # the fixture renders in that sandbox without touching anything unsafe (rendered above), and
    # its special tags are single tokens of the real tokenizer
    prompt = template.render(messages=MESSAGES, tools=TOOLS, add_generation_prompt=True)
    tok = qwen35_tokenizer()
    ids = tok.encode(prompt)
    for tag, n in (("<|im_start|>", 8), ("<|im_end|>", 7), ("<tool_response>", 2), ("<think>", 3)):
        assert ids.count(tok.token_to_id(tag)) == n, tag
    assert tok.decode(ids) == prompt
