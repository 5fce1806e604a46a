"""``tandem serve`` and ``tandem run`` refuse with one line and an exit code, never a traceback or an abort.

- ``tandem serve`` with a busy cache directory or a taken port: exit 1 within 2 s, one line, before any
  weight loads (the default model's 98 MB of weights take seconds to read).
- ``tandem run``: an empty prompt, ids that are not integers or not in the vocabulary, ``--max-tokens`` 0
  or -3: exit 2; a plugin's load error (a ``ConfigError`` of the Qwen3.8 config reader, its ``ServeError``,
  a missing file): exit 1, one line naming the file and the field. ``tandem serve`` the same.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from conftest_qwen38 import PLUGIN_SRC, qwen38_ckpts  # noqa: E402,F401  (fixture)
from replay_server import ROOT, free_port, write_model  # noqa: E402

pytestmark = pytest.mark.server

CACHE = ROOT / ".tandem-test-cache"


def tandem(*args: str, home: Path, plugins: str = "", timeout: float = 120) -> tuple[int, str, str, float]:
    env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_DISABLE_ENTRYPOINTS": "1",
           "TANDEM_EXTRA_PLUGINS": plugins,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "plugins"), str(PLUGIN_SRC), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tandem_core.cli.main", *args], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.perf_counter() - t0


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr
    return lines[0]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    from tandem_core import catalog
    from tandem_core.pull import pull

    return pull(catalog.entry("smollm2-135m").data, home=CACHE)


def test_serve_refuses_a_busy_cache_directory_before_loading(smollm2_path, tmp_path):
    from tandem_core.server.cachedir import lock_directory

    held = lock_directory("smollm2-135m", tmp_path / "cache")
    try:
        rc, _, err, took = tandem("serve", "--weights", str(smollm2_path), "--model", "smollm2-135m",
                                  "--cache-dir", str(tmp_path / "cache"), "--port", str(free_port()),
                                  home=tmp_path / "home", plugins="tandem_llama.plugin")
    finally:
        held.close()
    line = one_line(err)
    assert rc == 1 and took < 2.0, (rc, took, err)
    assert "in use by another tandem process" in line and str(tmp_path / "cache") in line


def test_serve_refuses_a_taken_port_before_loading(smollm2_path, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err, took = tandem("serve", "--weights", str(smollm2_path), "--model", "smollm2-135m",
                                  "--port", str(port), home=tmp_path / "home", plugins="tandem_llama.plugin")
    line = one_line(err)
    assert rc == 1 and took < 2.0, (rc, took, err)
    assert f"port {port}" in line and "already in use" in line


@pytest.fixture(scope="module")
def replay_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("cli") / "model", [])


@pytest.mark.parametrize("args,needle", [
    (["--prompt", ""], "--prompt: empty"),
    (["--ids", "1,abc"], "'abc' is not a token id"),
    (["--ids", "99999999"], "token id 99999999 is outside the vocabulary"),
    (["--ids", "1", "--max-tokens", "0"], "--max-tokens: must be >= 1, not 0"),
    (["--ids", "1", "--max-tokens", "-3"], "--max-tokens: must be >= 1, not -3"),
])
def test_run_usage_errors_are_one_line_exit_2(replay_dir, tmp_path, args, needle):
    rc, out, err, _ = tandem("run", "--weights", str(replay_dir), "--model", "replay-test", *args,
                             home=tmp_path, plugins="replay_plugin")
    assert rc == 2 and needle in one_line(err), (rc, err)


def test_run_still_runs(replay_dir, tmp_path):
    rc, out, err, _ = tandem("run", "--weights", str(replay_dir), "--model", "replay-test", "--prompt", "hi",
                             "--max-tokens", "8", home=tmp_path, plugins="replay_plugin")
    assert rc == 0 and out.strip() == "Hello there!", (out, err)


def _broken(src: Path, dst: Path, what: str) -> Path:
    shutil.copytree(src, dst)
    if what == "config":        # partial_rotary_factor beside rope_parameters, disagreeing with it
        cfg = json.loads((dst / "config.json").read_text())
        cfg["partial_rotary_factor"] = 0.5
        (dst / "config.json").write_text(json.dumps(cfg))
    elif what == "tokenizer":   # the plugin's own ServeError
        (dst / "tokenizer.json").unlink()
    elif what == "weights":     # a missing shard
        for f in dst.glob("*.safetensors"):
            f.unlink()
    return dst


@pytest.mark.parametrize("what,needles", [
    ("config", ["config.json", "partial_rotary_factor"]),
    ("tokenizer", ["tokenizer.json"]),
    ("weights", [".safetensors"]),
])
@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_plugins_load_error_is_one_line_naming_the_file_exit_1(qwen38_ckpts, tmp_path, what, needles,  # noqa: F811
                                                                 command):
    d = _broken(qwen38_ckpts.text.path, tmp_path / "ckpt", what)
    extra = ["--ids", "1,2"] if command == "run" else ["--no-cache", "--port", str(free_port())]
    rc, _, err, _ = tandem(command, "--weights", str(d), "--model", "tiny", *extra, home=tmp_path / "home",
                           plugins="tandem_qwen38.plugin")
    line = [ln for ln in err.splitlines() if ln.startswith(f"tandem {command}:")]
    assert rc == 1 and len(line) == 1, (rc, err)
    assert "Traceback" not in err and "terminate called" not in err
    assert str(d) in line[0] and all(n in line[0] for n in needles), line[0]


def test_serve_refuses_a_tool_format_no_plugin_registered(tmp_path):
    """The server finds formats only through the registry: a model naming one nobody registered is refused at
    start, one line naming it and the known ones (``qwen_xml`` is the Qwen plugin's: not loaded here)."""
    d = write_model(tmp_path / "model", [], tool_format="qwen_xml")
    rc, _, err, _ = tandem("serve", "--weights", str(d), "--model", "replay-test", "--no-cache", "--port",
                           str(free_port()), home=tmp_path / "home", plugins="replay_plugin")
    line = [ln for ln in err.splitlines() if ln.startswith("tandem serve:")]
    assert rc == 1 and len(line) == 1 and "Traceback" not in err, (rc, err)
    line = line[0]
    assert "'qwen_xml'" in line and "known: hermes_json, none" in line, line
