"""The caches through a real ``tandem serve`` of the tiny Qwen3.8 checkpoint and the ``openai`` client.

- An agent session (turn n+1 = turn n's prompt + answer + tool result, as token ids on
  ``/v1/completions``): each later turn's prefill starts at the end anchor of the last
  generation (log line, ``/metrics``, ``/health``), and every answer equals the answer of
  a server with ``--no-cache``.
- A restart (SIGTERM, start again on the same cache directory) resumes the session from
  the spill: the next turn's prefill starts where the spilled session ended.
- The memory gate (``--mem-peak``): a prompt over it fails alone with a 507 naming the
  bytes it needs and the bytes available; the next request succeeds.
- The disk tier, filled beforehand by this process for the server's own fingerprint: an
  entry is restored (``prefill=disk``); a corrupted file and a file computed under
  another fingerprint (another prefill chunk) are dropped with a log line, and those
  requests still answer as the cold server does.
- In-process: a corrupt spill is dropped with a log line and the caches start clean;
  an engine whose state is not live gets no caches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conftest_qwen38 import PLUGIN_SRC, qwen38_ckpts  # noqa: F401  (fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))

from replay_server import ROOT, free_port  # noqa: E402

from tandem_core.serving import ServeArgs, ServeContext  # noqa: E402

pytestmark = pytest.mark.server  # starts processes

MAX_CONTEXT = 1024
ANSWER = 8          # tokens a turn generates
LONG = 1000         # a prompt over the memory gate


class QwenServer:
    """``tandem serve`` of a checkpoint directory in a subprocess; its stderr (the log) kept."""

    def __init__(self, ckpt: Path, home: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_DISABLE_ENTRYPOINTS": "1",
                    "TANDEM_EXTRA_PLUGINS": "tandem_qwen38.plugin",
                    "PYTHONPATH": os.pathsep.join([str(PLUGIN_SRC), str(ROOT),
                                                   os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        cmd = [sys.executable, "-m", "tandem_core.cli.main", "serve", "--weights", str(ckpt),
               "--model", "tiny", "--port", str(self.port), "--max-context", str(MAX_CONTEXT),
               "--ledger", str(home / "ledger.sqlite"), *args]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=str(ROOT))
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, i=into: [i.append(ln) for ln in s], daemon=True).start()
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", timeout=60,
                                    max_retries=0)

    def ready(self, timeout: float = 90.0) -> "QwenServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("serving" in ln for ln in self.out):
                return self
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise RuntimeError(f"tandem serve exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"tandem serve not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return "".join(self.err)

    def line(self, rid: str) -> str:
        return next(ln for ln in self.log().splitlines() if f"req={rid} " in ln)

    def health(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=10).json()

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text

    def complete(self, prompt: list[int], max_tokens: int = ANSWER) -> tuple[list[int], str, str]:
        """Greedy completion of token ids: ``(answer ids, finish reason, request id)``."""
        r = self.client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           logprobs=0)
        c = r.choices[0]
        return [TOKENS[t] for t in c.logprobs.tokens], c.finish_reason, r.id

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        time.sleep(0.1)     # the log pump reads the last lines
        return self.proc.returncode


TOKENS: dict[str, int] = {}


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (n,), generator=g).tolist()


def held(prompt: list[int], answer: list[int], finish: str) -> int:
    """Tokens the engine holds after a turn: every pick but the last was forwarded (a stop id is not in
    ``answer``, so then all of ``answer`` was)."""
    return len(prompt) + len(answer) - (1 if finish == "length" else 0)


@pytest.fixture(scope="module")
def ckpt(qwen38_ckpts):  # noqa: F811
    from tandem_core.tokenizer import HFTokenizer

    path = qwen38_ckpts.text.path
    tok = HFTokenizer.from_dir(path)
    TOKENS.update({tok.decode([i]): i for i in range(tok.vocab_size)})
    return path


def _served(ckpt: Path, **options):
    from tandem_qwen38.serving import serve

    return serve(ServeArgs(model_id="tiny", path=ckpt, max_context=MAX_CONTEXT, options=options),
                 ServeContext())


DISK_A, DISK_B, DISK_C = ids(300, 101), ids(300, 102), ids(300, 103)


@pytest.fixture(scope="module")
def disk_dir(ckpt, tmp_path_factory) -> Path:
    """A cache directory whose disk tier holds A (good), B (then corrupted) for the server's fingerprint,
    and C computed by another engine (prefill chunk 256: another fingerprint)."""
    from tandem_core.cache import CacheStack, DiskTier, ResidentPrefix
    from tandem_core.server.caches import fingerprint

    root = tmp_path_factory.mktemp("disk-cache")

    def write(directory: Path, served, prompts: list[list[int]]) -> DiskTier:
        tier = DiskTier(directory, fingerprint(served.engine, served.tokenizer), 1 << 30)
        for p in prompts:
            stack = CacheStack(ResidentPrefix(1024))
            with torch.inference_mode():
                stack.prefill(served.engine, p)
            assert tier.offer(stack.snapshot(served.engine))
        return tier

    tier = write(root / "disk", _served(ckpt), [DISK_A, DISK_B])
    other = write(root / "other", _served(ckpt, prefill_chunk=256), [DISK_C])
    assert tier.fingerprint != other.fingerprint
    # B's file: a byte flipped in its tensors (its sha256 no longer matches the manifest's)
    b_file = next(tier.path(k) for k, e in tier.entries().items() if e.length == 300 and k != _key(DISK_A))
    data = bytearray(b_file.read_bytes())
    data[-7] ^= 0xFF
    b_file.write_bytes(bytes(data))
    # C's file and manifest record join the server's directory
    (c_key, c_entry), = other.entries().items()
    (root / "disk" / c_entry.file).write_bytes(other.path(c_key).read_bytes())
    manifest = json.loads((root / "disk" / "manifest.json").read_text())
    manifest["entries"][c_key] = json.loads((root / "other" / "manifest.json").read_text())["entries"][c_key]
    (root / "disk" / "manifest.json").write_text(json.dumps(manifest))
    return root


def _key(tokens: list[int]) -> str:
    import numpy as np

    from tandem_core.cache.keys import sequence_key

    return sequence_key(np.asarray(tokens, dtype=np.int64))


@pytest.fixture(scope="module")
def servers(ckpt, disk_dir, tmp_path_factory):
    """Three servers started at once: cold (--no-cache), warm (caches on), disk (the filled disk tier)."""
    home = tmp_path_factory.mktemp("home")
    started = {
        "cold": QwenServer(ckpt, home / "cold", "--no-cache"),
        "warm": QwenServer(ckpt, home / "warm", "--cache-dir", str(home / "warm-cache")),
        "disk": QwenServer(ckpt, home / "disk", "--cache-dir", str(disk_dir)),
    }
    try:
        for s in started.values():
            s.ready()
        yield started, home
    finally:
        for s in started.values():
            s.terminate()


def test_agent_session_resumes_at_the_end_anchor_and_through_a_restart(servers, ckpt):
    srv, home = servers
    cold, warm = srv["cold"], srv["warm"]
    prompt = ids(300, 1)
    prev: tuple[list[int], list[int], str] | None = None
    starts = []
    for turn in range(3):
        answer, finish, rid = warm.complete(prompt)
        assert (answer, finish) == cold.complete(prompt)[:2], f"turn {turn}: the cached answer differs"
        line = warm.line(rid)
        start = 0 if prev is None else held(*prev)
        want = "cold" if prev is None else "resident"
        assert f"prefill={want}:{start}/{len(prompt)} " in line, line
        starts.append(start)
        prev = (prompt, answer, finish)
        prompt = prompt + answer + ids(40, 10 + turn)         # + the tool result
    metrics = warm.metrics()
    assert 'tandem_prefills_total{start="resident"} 2' in metrics
    assert 'tandem_prefills_total{start="cold"} 1' in metrics
    assert re.search(r'^tandem_cache_hits_total\{tier="resident"\} 2$', metrics, re.M)
    reused = int(re.search(r'^tandem_prefill_tokens_total\{part="reused"\} (\d+)$', metrics, re.M).group(1))
    assert reused == sum(starts) and starts[1] > 300 and starts[2] > starts[1]
    h = warm.health()["caches"]
    last = h["engines"][0]["last_prefill"]
    assert last["tier"] == "resident" and last["anchor"] and last["total"] == len(prev[0])
    assert {t["tier"] for t in h["tiers"]} == {"resident", "store", "disk", "spill"}
    assert "prefill started: resident anchor at" in warm.log()

    # SIGTERM: the session is spilled; a new server on the same directory resumes it, with a memory gate
    assert warm.terminate() in (0, -signal.SIGTERM)    # uvicorn re-raises the signal once it has shut down
    assert "session spill: 1 sessions" in warm.log()
    gate = _gate_for(ckpt, len(prompt))
    base = h["gate"]["base"]
    peak = base + (gate["turn"] + gate["long"]) // 2
    again = QwenServer(ckpt, home / "warm", "--cache-dir", str(home / "warm-cache"),
                       "--mem-peak", str(peak)).ready()
    try:
        assert "session spill: engine 0 resumes a session of" in again.log()
        answer, finish, rid = again.complete(prompt)
        assert (answer, finish) == cold.complete(prompt)[:2]
        assert f"prefill=resident:{held(*prev)}/{len(prompt)} " in again.line(rid)

        # a prompt over the gate fails alone, naming what it needs and what there is
        with pytest.raises(openai.APIStatusError) as err:
            again.complete(ids(LONG, 7), max_tokens=4)
        assert err.value.status_code == 507
        msg = str(err.value)
        assert f"a prompt of {LONG} tokens needs {gate['long']} bytes" in msg
        assert "available under the declared peak" in msg
        with pytest.raises(openai.APIStatusError) as err:       # streamed: refused before the stream opens
            again.client.completions.create(model="tiny", prompt=ids(LONG, 8), max_tokens=4, stream=True)
        assert err.value.status_code == 507 and "needs" in str(err.value)
        assert "refused=memory_gate" in again.log()
        assert 'tandem_rejected_total{reason="memory_gate"} 2' in again.metrics()
        # and the session goes on
        nxt = prompt + answer + ids(40, 20)
        answer2, finish2, rid = again.complete(nxt)
        assert (answer2, finish2) == cold.complete(nxt)[:2]
        assert f"prefill=resident:{held(prompt, answer, finish)}/{len(nxt)} " in again.line(rid)
    finally:
        again.terminate()


def _gate_for(ckpt: Path, turn_len: int) -> dict[str, int]:
    """What the server's memory gate computes: the next turn's need (as if cold) and the long prompt's."""
    from tandem_core.cache import MemoryGate
    from tandem_core.server.caches import workspace_estimate

    served = _served(ckpt)
    g = MemoryGate(workspace_estimate(served.engine, 512, served.tokenizer.vocab_size),
                   served.engine.state.view_bytes_per_token())
    turn, long = g.need(turn_len + ANSWER + 40, 0).total, g.need(LONG, 0).total
    assert long - turn > 1 << 20      # room for the caches the session holds
    return {"turn": turn, "long": long}


def test_disk_tier_restores_and_drops_a_corrupt_file_and_another_fingerprint(servers):
    srv, _ = servers
    cold, disk = srv["cold"], srv["disk"]
    log = disk.log()
    assert "disk cache: dropped" in log and "computed under fingerprint" in log   # C, when the tier opened
    for name, base, tool, want in (("A", DISK_A, 201, "disk:300/"), ("B", DISK_B, 202, "cold:0/"),
                                   ("C", DISK_C, 203, "cold:0/")):
        prompt = base + ids(30, tool)
        answer, finish, rid = disk.complete(prompt)
        assert (answer, finish) == cold.complete(prompt)[:2], f"{name}: not the cold server's answer"
        assert f"prefill={want}{len(prompt)} " in disk.line(rid), (name, disk.line(rid))
    dropped = [ln for ln in disk.log().splitlines() if "disk cache: dropped" in ln]
    assert len(dropped) == 2 and any("sha256" in ln or "sum" in ln for ln in dropped), dropped
    tiers = {t["tier"]: t for t in disk.health()["caches"]["tiers"]}
    assert tiers["disk"]["hits"] == 1 and tiers["disk"]["entries"] == 1


# -- in-process: the server's wiring -------------------------------------------------------------------------

def test_a_corrupt_spill_is_dropped_and_the_caches_start_clean(ckpt, tmp_path, caplog):
    from tandem_core.serving import Served
    from tandem_core.server.caches import CacheOptions, build_caches

    def caches_for(served):
        c = build_caches(Served("tiny", served.engine, served.tokenizer, ""), [served.engine],
                         CacheOptions(directory=tmp_path))
        assert c is not None
        return c

    served = _served(ckpt)
    caches = caches_for(served)
    with torch.inference_mode():
        caches.engine(0).start(served.engine, ids(200, 5))
    spill = caches.save_sessions()
    caches.close()
    assert spill is not None
    for f in spill.glob("session-*.safetensors"):
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x55
        f.write_bytes(bytes(data))
    fresh = _served(ckpt)
    caches = caches_for(fresh)
    with caplog.at_level("WARNING", logger="tandem.cache"):
        assert caches.restore() == 0
    assert any("session spill: dropped session" in r.getMessage() for r in caplog.records)
    assert fresh.engine.kv.length == 0 and caches.engine(0).stack.resident.length == 0
    with pytest.raises(Exception, match="in use by another tandem process"):
        caches_for(fresh)           # one process a directory
    caches.close()


def test_an_engine_whose_state_is_not_live_gets_no_caches(tmp_path, caplog):
    from replay_plugin import ReplayEngine  # its ``state`` is a copy: kv.length does not follow a restore

    from tandem_core.serving import Served
    from tandem_core.server.caches import CacheOptions, build_caches
    from replay_server import build_tokenizer
    from tandem_core.tokenizer import HFTokenizer

    tok = HFTokenizer(build_tokenizer(), eos_tokens=["<|im_end|>"])
    engine = ReplayEngine({"scripts": [], "default": "hi"}, tok, 64)
    with caplog.at_level("WARNING", logger="tandem.cache"):
        caches = build_caches(Served("replay", engine, tok, ""), [engine], CacheOptions(directory=tmp_path))
    assert caches is None
    assert any("caches off" in r.getMessage() for r in caplog.records)
