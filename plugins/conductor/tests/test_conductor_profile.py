"""Profile files: schema errors name the file, the line and the key; ``tandem serve --conductor`` refuses a bad
one before anything loads (one line, exit 1); the monitor's pieces on their own (n-gram repeats, argument repair
against a JSON schema, the memory block cutter, status-line stripping, session keys)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem_conductor import profile
from tandem_conductor.monitor import MemoryCutter, repair_arguments, repeats_at_end
from tandem_conductor.sessions import prefix_keys, strip_status
from tandem_core.server.conduct import ConductorError
from replay_server import child_env  # noqa: E402  (tests/plugins is on the test path)

ROOT = Path(__file__).resolve().parents[3]
GOOD = """\
default_profile: main
packages:
  python:
    text: Prefer the standard library.
clients:
  - user_agent: "^opencode/"
    profile: main
profiles:
  main:
    classes:
      quick:
        thinking_budget: 256
        packages: [python]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "profile.yaml"
    p.write_text(text)
    return p


def test_a_good_profile_loads(tmp_path):
    cfg = profile.load(write(tmp_path, GOOD))
    assert cfg.model_name == "TandemLLM" and cfg.default_profile == "main"
    main = cfg.profiles["main"]
    assert main.classes["quick"].thinking_budget == 256 and main.default_class == "quick"
    assert cfg.packages["python"] == "Prefer the standard library."
    assert cfg.clients[0].user_agent.search("opencode/0.15.0 ai-sdk/provider-utils/3.0.9")


@pytest.mark.parametrize("old,new,line,key", [
    ("        thinking_budget: 256", "        thinking_budget: lots", 12, "profiles.main.classes.quick.thinking_budget"),
    ("        thinking_budget: 256", "        thinking_budgett: 256", 12, "profiles.main.classes.quick.thinking_budgett"),
    ("    profile: main", "    profile: other", 7, "clients[0].profile"),
    ("        packages: [python]", "        packages: [rust]", 13, "profiles.main.classes.quick.packages[0]"),
    ("  - user_agent: \"^opencode/\"", "  - user_agent: \"(\"", 6, "clients[0].user_agent"),
    ("default_profile: main", "default_profile: nope", 1, "default_profile"),
])
def test_an_error_names_the_file_the_line_and_the_key(tmp_path, old, new, line, key):
    p = write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(ConductorError) as exc:
        profile.load(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}: line {line}: {key}:"), msg


def test_yaml_that_does_not_parse_names_the_line(tmp_path):
    p = write(tmp_path, "profiles:\n  main: [\n")
    with pytest.raises(ConductorError, match=r"line \d+"):
        profile.load(p)


def test_tandem_serve_refuses_a_bad_profile_before_anything_loads(tmp_path):
    p = write(tmp_path, GOOD.replace("thinking_budget: 256", "thinking_budget: -1"))
    env = child_env(ROOT, ROOT / "plugins" / "conductor", TANDEM_HOME=str(tmp_path / "home"),
                    TANDEM_DISABLE_ENTRYPOINTS="1", TANDEM_EXTRA_PLUGINS="tandem_conductor.plugin")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text(json.dumps({"architectures": ["Nothing"]}))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "serve", "--weights", str(tmp_path / "weights"),
                        "--conductor", str(p), "--port", "0"], env=env, cwd=str(ROOT), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{p}: line 12: profiles.main.classes.quick.thinking_budget:" in lines[0]
    assert time.monotonic() - t0 < 60


def test_repeats_at_end_counts_the_last_ngram():
    assert repeats_at_end([1, 2, 3, 1, 2, 3, 1, 2, 3], 3, 64) == 3
    assert repeats_at_end(list(range(20)), 3, 64) == 1
    assert repeats_at_end([1, 2], 3, 64) == 0


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "flags": {"type": "array",
                                                                                           "items": {"type": "boolean"}}}}


@pytest.mark.parametrize("raw,fixed,repaired", [
    ('{"city": "Paris"}', {"city": "Paris"}, False),
    ('{"city": "Paris", "days": "3"}', {"city": "Paris", "days": 3}, True),
    ('{"city": "Paris", "days": 3', {"city": "Paris", "days": 3}, True),
    ('{"city": "Paris", "flags": ["true", false],}', {"city": "Paris", "flags": [True, False]}, True),
    ('{"town": "Paris"}', None, True),
    ('not json', None, True),
])
def test_arguments_are_repaired_against_the_schema(raw, fixed, repaired):
    out, was = repair_arguments(raw, SCHEMA)
    assert was == repaired
    assert (json.loads(out) if out is not None else None) == fixed


def test_memory_blocks_are_cut_out_across_chunks():
    cut = MemoryCutter()
    text = "Sure.<tandem_memory>likes tea</tandem_memory> Done."
    out = "".join(cut.feed(text[i:i + 3]) for i in range(0, len(text), 3)) + cut.flush()
    assert out == "Sure. Done." and cut.blocks == ["likes tea"]


def test_status_lines_are_stripped_and_keys_follow_the_conversation():
    assert strip_status("\u203a reading 1,024 tokens, about 2 s left\nHello") == "Hello"
    assert strip_status("a \u203a b\n") == "a \u203a b\n"
    one = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    two = [*one, {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    k1, k2 = prefix_keys(one), prefix_keys(two)
    assert k1[1] == k2[1] and set(k2) == {1, 3} and k2[3] != k2[1]
    assert prefix_keys([{"role": "system", "content": "t"}, {"role": "user", "content": "u"}])[1] != k1[1]


def test_a_journal_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "plugins"))
    from script_plugin import write_script_model

    model = write_script_model(tmp_path / "model", [])
    p = write(tmp_path, "journal: /proc/no-such-dir/journal.jsonl\n" + GOOD)
    env = child_env(Path(__file__).resolve().parent, ROOT / "tests" / "plugins", ROOT,
                    ROOT / "plugins" / "conductor",
                    TANDEM_HOME=str(tmp_path / "home"), TANDEM_DISABLE_ENTRYPOINTS="1",
                    TANDEM_EXTRA_PLUGINS="script_plugin,tandem_conductor.plugin")
    r = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", "serve", "--weights", str(model),
                        "--model", "script-test", "--conductor", str(p), "--port", "0"], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert f"{p}: journal: /proc/no-such-dir/journal.jsonl cannot be written" in last, r.stderr
