"""The product on the GPU, measured through the API the way a user runs it (a script, not a test).

    python3 tools/bench_serve_gpu.py --out DIR [--shape 27b|9layers|tiny] [--ckpt DIR] [--device cuda]
                                     [--budget S] [--peer] [--skip PART,...]

1. A random-weight checkpoint at the shape (``27b``: the Qwen3.8-27B shape, 53.8 GB of bf16) written as
   safetensors shards, with a word-level tokenizer over the whole vocabulary and the Qwen chat template
   (``--ckpt`` keeps it; an existing one is reused).
2. ``tandem serve --model CKPT --device cuda`` started as a user starts it (a subprocess, its own port);
   its load time, host peak RSS and device memory read from outside.
3. With the official ``openai`` client (token-id prompts through ``/v1/completions``, so lengths are exact):
   - streamed decode: tokens/s as the client sees them, against the server's own decode rate (its log line);
   - time to first token for 2K, 8K, 32K and 128K-token prompts (each new, so no cache helps);
   - a 10-turn agent session (each turn the previous prompt + the answer + a tool result of 300 tokens):
     time to first token per turn, warm, against a cold prompt of the new tokens alone;
   - short requests (chat, 16 tokens) sent one a second during a 600-token generation: the side lane on
     (default) and off (``TANDEM_SIDE_LANE=0``, a second server);
   - speculation on (``--spec lookup``, the default) against off (``--spec off``, a third server) on random
     weights, where no draft is ever accepted: the cost of drafting and verifying for nothing;
   - peak device memory (``nvidia-smi``) against the memory the server says it holds (``/health``).
4. ``--peer``: transformers on the same checkpoint (``from_pretrained``, bf16, sdpa), with and without
   flash-linear-attention importable, decode and prefill, in the same run.

Everything measured goes to ``DIR/serve.json`` as it comes and ``DIR/serve.md`` at the end (the table for
docs/measurements/h200-serve.md); a stage past ``--budget`` seconds is skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
T0 = time.time()

SHAPES = {
    "27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
    "9layers": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=8,
                    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128),
    "tiny": dict(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


class Results:
    def __init__(self, out: Path, budget: float) -> None:
        self.out, self.budget = out, budget
        self.data: dict[str, Any] = {"skipped": [], "errors": {}}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        (self.out / "serve.json").write_text(json.dumps(self.data, indent=1, default=str))

    def stage(self, name: str, skip: set[str]):
        res = self

        class _S:
            def __enter__(self):
                self.run = name not in skip and time.time() - T0 < res.budget
                if not self.run:
                    res.data["skipped"].append(name)
                log(("-- " if self.run else "-- skipped: ") + name)
                return self

            def __exit__(self, et, ev, tb):
                if et is not None:
                    import traceback

                    res.data["errors"][name] = "".join(traceback.format_exception(et, ev, tb))[-2500:]
                    log(f"!! {name} failed: {ev!r}")
                    res.put("errors", res.data["errors"])
                return True
        return _S()


# -- the checkpoint ----------------------------------------------------------------------------------------
def write_checkpoint(d: Path, shape: str, device: str, seed: int = 0) -> dict[str, Any]:
    """A random bf16 checkpoint of ``shape`` in ``d`` (safetensors shards of about 4 GB), with its tokenizer."""
    import torch
    from safetensors.torch import save_file

    sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "qwen38_27b")]
    from tandem_qwen38.config import read_config
    from tandem_qwen38.weights import expected_tensors

    s = SHAPES[shape]
    raw = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **s,
           "layer_types": [("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                           for i in range(s["num_hidden_layers"])],
           "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
           "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": 2,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
    cfg = read_config(raw)
    d.mkdir(parents=True, exist_ok=True)
    if (d / "model.safetensors.index.json").exists() and (d / "config.json").exists():
        log(f"checkpoint {d} exists: reused")
        return json.loads((d / "meta.json").read_text())
    t = time.time()
    g = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, n, weight_map, total = 0, 0, {}, 0
    names = sorted(expected_tensors(cfg).items())

    def flush() -> None:
        nonlocal shard, size, n
        if not shard:
            return
        fname = f"model-{n:05d}.safetensors"
        save_file({k: v.cpu() for k, v in shard.items()}, str(d / fname))
        for k in shard:
            weight_map[k] = fname
        shard, size, n = {}, 0, n + 1

    for name, exp in names:
        shp = tuple(exp.shape)
        if name.endswith("A_log"):
            v = torch.log(torch.rand(shp, device=device, generator=g) * 15 + 1)
        elif len(shp) >= 2:
            v = torch.randn(shp, device=device, generator=g) * shp[-1] ** -0.5
        else:
            v = torch.randn(shp, device=device, generator=g) * 0.1
        key = "model." + name if not name.startswith("lm_head") else name
        shard[key] = v.to(torch.bfloat16)
        size += shard[key].numel() * 2
        total += shard[key].numel() * 2
        if size >= 4 << 30:
            flush()
    flush()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(raw))
    write_tokenizer(d, s["vocab_size"])
    meta = {"shape": shape, "bytes": total, "tensors": len(names), "write_s": round(time.time() - t, 1),
            "layers": s["num_hidden_layers"]}
    (d / "meta.json").write_text(json.dumps(meta))
    log(f"checkpoint written: {total / 1e9:.1f} GB in {meta['write_s']} s")
    return meta


def write_tokenizer(d: Path, vocab: int) -> None:
    """A word-level tokenizer over the whole vocabulary (``w<i>``), the specials at ids 0..6, and the repo's
    Qwen3.8 chat template (tool calls in Qwen's XML form)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = {t: i for i, t in enumerate(SPECIALS)}
    words.update({f"w{i}": i for i in range(len(SPECIALS), vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(d / "tokenizer.json"))
    template = (ROOT / "tests" / "fixtures" / "qwen38_chat_template.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))


# -- a server ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, ckpt: Path, home: Path, device: str, max_context: int, *args: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        tandem = shutil.which("tandem") or str(Path(sys.executable).with_name("tandem"))
        if not Path(tandem).exists():
            raise RuntimeError("no `tandem` command: install TandemLLM first (pip install . plugins/qwen38_27b ...)")
        cmd = [tandem, "serve", "--model", str(ckpt), "--device", device, "--port", str(self.port),
               "--max-context", str(max_context), *args]
        e = {**os.environ, "TANDEM_HOME": str(home), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "tandem: serving" in line:
                self.ready.set()

    def wait(self, timeout: float) -> float:
        import httpx

        if not self.ready.wait(timeout):
            raise RuntimeError("server not ready:\n" + "\n".join(self.lines[-40:]))
        load = time.time() - self.t0
        deadline = time.time() + timeout
        while httpx.get(self.url + "/health").json()["speculation"].get("reason") == "self-check running":
            if time.time() > deadline:
                raise RuntimeError("the self-check did not finish")
            time.sleep(0.5)
        return load

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=900)

    @property
    def model(self) -> str:
        """The id the server serves (the checkpoint's name)."""
        return self.client().models.list().data[0].id

    def health(self) -> dict[str, Any]:
        import httpx

        return httpx.get(self.url + "/health", timeout=30).json()

    def peak_rss(self) -> int:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        m = re.search(r"VmHWM:\s+(\d+) kB", text)
        return int(m.group(1)) * 1024 if m else 0

    def device_bytes(self) -> int:
        """This process's device memory as nvidia-smi sees it (0 where there is none)."""
        try:
            q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return 0
        for line in q.splitlines():
            pid, mib = (x.strip() for x in line.split(","))
            if pid.isdigit() and int(pid) == self.proc.pid:
                return int(mib) << 20
        return sum(int(x.split(",")[1]) << 20 for x in q.splitlines() if "," in x)

    def server_ttfts(self) -> list[float]:
        """The server's own time to first token (arrival to first token), from its request log lines."""
        return [float(m.group(1)) for line in self.lines for m in [re.search(r" ttft=([\d.]+)s", line)] if m]

    def decode_rates(self) -> list[float]:
        return [float(m.group(1)) for line in self.lines for m in [re.search(r"decode=([\d.]+)tok/s", line)] if m]

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- measurements --------------------------------------------------------------------------------------------
VOCAB_LO = len(SPECIALS) + 10
BIAS = {"2": -100, "0": -100}          # the end tokens never win: every answer runs to max_tokens


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, vocab) for _ in range(n)]


class Streamed:
    """One streamed completion: time to first token, when the first and last text came, the tokens (usage)."""

    def __init__(self, ttft: float, first: float, last: float, tokens: int, text: str) -> None:
        self.ttft, self.first, self.last, self.tokens, self.text = ttft, first, last, tokens, text

    @property
    def rate(self) -> float:
        """Tokens a second after the first one."""
        span = self.last - self.first
        return (self.tokens - 1) / span if span > 0 and self.tokens > 1 else 0.0


def stream_times(client: Any, prompt: list[int], max_tokens: int, model: str, **sampling: Any) -> Streamed:
    t = time.perf_counter()
    first = last = None
    text, tokens = [], 0
    kw = {"temperature": 0, **sampling}
    for ev in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, logit_bias=BIAS,
                                        stream=True, stream_options={"include_usage": True}, **kw):
        if ev.usage is not None:
            tokens = ev.usage.completion_tokens
        if not ev.choices or not ev.choices[0].text:
            continue
        now = time.perf_counter()
        first = now if first is None else first
        last = now
        text.append(ev.choices[0].text)
    first = first or time.perf_counter()
    return Streamed(first - t, first, last or first, tokens, "".join(text))


def decode_stage(srv: Server, R: Results, vocab: int, ctx: int, n: int) -> None:
    client, rng, model = srv.client(), random.Random(1), srv.model
    stream_times(client, ids(rng, 512, vocab), 32, model)                  # warm
    got = stream_times(client, ids(rng, ctx, vocab), n, model)
    client_rate = got.rate
    server_rate = srv.decode_rates()[-1] if srv.decode_rates() else 0.0
    R.put("decode", {"context": ctx, "tokens": got.tokens, "ttft_s": round(got.ttft, 3),
                     "client_tok_s": round(client_rate, 2),
                     "client_ms_token": round(1e3 / client_rate, 2) if client_rate else None,
                     "server_tok_s": server_rate,
                     "overhead_pct": round(100 * (1 - client_rate / server_rate), 2) if server_rate else None})
    log(f"decode at {ctx}: client {client_rate:.1f} tok/s, server {server_rate:.1f} tok/s")


def client_build_s(prompt: list[int], model: str) -> float:
    """What the ``openai`` client spends turning the request's parameters into its body before it sends anything
    (``maybe_transform`` walks the prompt's list element by element): a part of the client's time to first token
    that no server can shorten."""
    from openai._utils import maybe_transform
    from openai.types import completion_create_params as params

    t = time.perf_counter()
    maybe_transform({"model": model, "prompt": prompt, "max_tokens": 16, "stream": True, "temperature": 0,
                     "logit_bias": BIAS, "stream_options": {"include_usage": True}},
                    params.CompletionCreateParamsStreaming)
    return time.perf_counter() - t


def ttft_stage(srv: Server, R: Results, vocab: int, lengths: list[int]) -> None:
    client, rng, got, model = srv.client(), random.Random(2), {}, srv.model
    for T in lengths:
        if time.time() - T0 > R.budget:
            R.data["skipped"].append(f"ttft {T}")
            break
        prompt = ids(rng, T, vocab)
        r = stream_times(client, prompt, 16, model)
        time.sleep(0.2)                                                       # the request's log line
        server = srv.server_ttfts()
        got[T] = {"ttft_s": round(r.ttft, 3), "prefill_tok_s": round(T / r.ttft, 1) if r.ttft else None,
                  "decode_ms_token_there": round(1e3 / r.rate, 2) if r.rate else None,
                  "server_ttft_s": server[-1] if server else None,
                  "client_build_s": round(client_build_s(prompt, model), 3)}
        log(f"ttft {T}: {r.ttft:.2f} s")
        R.put("ttft", got)


def session_stage(srv: Server, R: Results, vocab: int, turns: int = 10, tool: int = 300, answer: int = 64) -> None:
    """The turns back to back (nothing else in between, as an agent's session runs), then a cold prompt of each
    turn's new tokens alone on its own (after the session: a cold prompt replaces the resident prefix)."""
    client, rng, model = srv.client(), random.Random(3), srv.model
    prompt, rows = ids(rng, 2000, vocab), []
    for turn in range(turns):
        got = stream_times(client, prompt, answer, model)
        out_ids = [int(w[1:]) for w in got.text.split() if w.startswith("w") and w[1:].isdigit()]
        new = out_ids + ids(rng, tool, vocab)
        rows.append({"turn": turn + 1, "prompt": len(prompt), "new_tokens": len(prompt) - (rows[-1]["prompt"]
                     if rows else 0), "warm_ttft_s": round(got.ttft, 3)})
        prompt = prompt + new
    for r in rows[1:]:
        cold = stream_times(client, ids(rng, r["new_tokens"], vocab), 1, model).ttft
        r.update(cold_new_tokens_s=round(cold, 3), ratio=round(r["warm_ttft_s"] / cold, 2) if cold else None)
    R.put("session", rows)
    log("session: " + ", ".join(f"{r['warm_ttft_s']}/{r.get('cold_new_tokens_s')}" for r in rows))


def side_stage(srv: Server, R: Results, vocab: int, key: str, long_tokens: int = 600, n_short: int = 5) -> None:
    client, rng, model = srv.client(), random.Random(4), srv.model
    done = threading.Event()

    def long_run() -> None:
        try:
            stream_times(client, ids(rng, 3000, vocab), long_tokens, model)
        finally:
            done.set()

    th = threading.Thread(target=long_run, daemon=True)
    th.start()
    time.sleep(2.0)
    lat = []
    for i in range(n_short):
        t = time.perf_counter()
        client.chat.completions.create(model=model, max_tokens=16, temperature=0, logit_bias=BIAS,
                                       messages=[{"role": "user", "content": " ".join(f"w{100 + i * 7 + j}"
                                                                                   for j in range(40))}],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        lat.append(time.perf_counter() - t)
        time.sleep(max(0.0, 1.0 - lat[-1]))
    th.join(timeout=900)
    R.put(key, {"latency_s": [round(x, 3) for x in lat], "median_s": round(statistics.median(lat), 3)})
    log(f"{key}: median {statistics.median(lat):.2f} s")


def spec_cost_stage(srv_on: Server, srv_off: Server, R: Results, vocab: int, ctx: int, n: int) -> None:
    rates = {}
    for name, srv in (("on", srv_on), ("off", srv_off)):
        client, model = srv.client(), srv.model
        stream_times(client, ids(random.Random(5), 512, vocab), 32, model)
        # sampled (seeded): random text never repeats, so the lookup drafter's drafts are never accepted
        rates[name] = stream_times(client, ids(random.Random(6), ctx, vocab), n, model, temperature=1.0,
                                   seed=7).rate
        h = srv.health()["speculation"]
        rates[f"{name}_health"] = {k: h.get(k) for k in ("enabled", "reason", "rounds", "drafted", "accepted")}
    R.put("speculation", {"on_tok_s": round(rates["on"], 2), "off_tok_s": round(rates["off"], 2),
                          "cost_pct": round(100 * (1 - rates["on"] / rates["off"]), 2),
                          "health": {k: rates[k] for k in ("on_health", "off_health")}})
    log(f"speculation on {rates['on']:.1f} / off {rates['off']:.1f} tok/s")


def memory_stage(srv: Server, R: Results, key: str = "memory") -> None:
    h = srv.health()
    parts = {m["name"]: m["bytes"] for m in h["memory"]}
    R.put(key, {"device_bytes_nvidia_smi": srv.device_bytes(), "engine_parts": parts,
                     "engine_parts_total": sum(parts.values()), "host_peak_rss": srv.peak_rss(),
                     "gate": h.get("caches", {}).get("gate"), "engine": h.get("engine"),
                     "host": host_kinds(srv)})


def host_kinds(srv: Server) -> dict[str, int]:
    """The server's ``tandem_host_memory_bytes`` (anon, file, peak) from its /metrics."""
    import httpx

    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return {m.group(1): int(m.group(2)) for m in re.finditer(r'^tandem_host_memory_bytes\{kind="(\w+)"\} (\d+)', text, re.M)}


# -- the peer ------------------------------------------------------------------------------------------------
PEER = r'''
import json, statistics, sys, time, torch
from transformers import AutoModelForCausalLM, DynamicCache
ckpt, out, fla = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if not fla:
    import builtins
    real = builtins.__import__
    def imp(name, *a, **k):
        if name == "fla" or name.startswith("fla."):
            raise ImportError("hidden")
        return real(name, *a, **k)
    builtins.__import__ = imp
t = time.time()
m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda", attn_implementation="sdpa").eval()
R = {"load_s": round(time.time() - t, 1), "fla": fla, "prefill": {}, "decode": {}}
V = m.config.vocab_size
def prefill(T):
    cache = DynamicCache(config=m.config)
    ids = torch.randint(20, V, (1, T), device="cuda")
    torch.cuda.synchronize(); t = time.perf_counter()
    with torch.no_grad():
        o = m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    return T / (time.perf_counter() - t), o.past_key_values, o.logits[:, -1].argmax(-1)
def decode(cache, tok, n):
    ts = []
    with torch.no_grad():
        for _ in range(n):
            torch.cuda.synchronize(); t = time.perf_counter()
            o = m(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
            tok = o.logits[:, -1].argmax(-1); torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts[n // 2:])
prefill(512)
for T in ([2048, 8192] if fla else [2048]):
    prefill(T)
    rate, cache, tok = prefill(T)
    R["prefill"][T] = round(rate, 1)
    if T == 2048:
        rate4, cache, tok = prefill(4096)
        R["decode"][4096] = round(decode(cache, tok, 10 if fla else 6), 2)
    del cache; torch.cuda.empty_cache()
open(out, "w").write(json.dumps(R))
print(json.dumps(R))
'''


def peer_stage(ckpt: Path, R: Results, out: Path) -> None:
    got = {}
    for fla in (True, False):
        if time.time() - T0 > R.budget:
            R.data["skipped"].append(f"peer fla={fla}")
            break
        path = out / f"peer_{'fla' if fla else 'torch'}.json"
        r = subprocess.run([sys.executable, "-c", PEER, str(ckpt), str(path), "1" if fla else "0"],
                           capture_output=True, text=True, timeout=max(60, int(R.budget - (time.time() - T0))))
        if r.returncode != 0:
            R.data["errors"][f"peer fla={fla}"] = r.stderr[-2500:]
            continue
        got["fla" if fla else "torch"] = json.loads(path.read_text())
        log(f"peer fla={fla}: {got['fla' if fla else 'torch']}")
        R.put("peer", got)


# -- the report ----------------------------------------------------------------------------------------------
def report(D: dict[str, Any]) -> str:
    lines = ["| measure | value |", "|---|---|"]
    ck = D.get("checkpoint", {})
    lines.append(f"| checkpoint | {ck.get('shape')} ({ck.get('layers')} layers), {ck.get('bytes', 0) / 1e9:.1f} GB "
                 f"bf16 safetensors, written in {ck.get('write_s')} s |")
    for k in ("load_s", "load_s_off", "load_s_nolane"):
        if k in D:
            lines.append(f"| `tandem serve` start to ready ({k}) | {D[k]:.1f} s |")
    m = D.get("memory", {})
    if m:
        lines.append(f"| host peak RSS (load and serve) | {m['host_peak_rss'] / 2**30:.2f} GiB |")
        if D.get('host_peak_at_ready'):
            lines.append(f"| host peak RSS when the server is ready (the load) | {D['host_peak_at_ready'] / 2**30:.2f} GiB |")
        lines.append(f"| device memory: nvidia-smi / the engine's parts | {m['device_bytes_nvidia_smi'] / 2**30:.2f} / "
                     f"{m['engine_parts_total'] / 2**30:.2f} GiB |")
    d = D.get("decode")
    if d:
        lines.append(f"| streamed decode at {d['context']} (client) | {d['client_tok_s']} tok/s = "
                     f"{d['client_ms_token']} ms/token |")
        lines.append(f"| the server's own decode rate / overhead | {d['server_tok_s']} tok/s / {d['overhead_pct']} % |")
    for T, v in sorted((D.get("ttft") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"| time to first token, {int(T):,}-token prompt | {v['ttft_s']} s ({v['prefill_tok_s']} tok/s); "
                     f"server's own {v.get('server_ttft_s')} s; the openai client's request build "
                     f"{v.get('client_build_s')} s; decode there {v['decode_ms_token_there']} ms/token |")
    for r in D.get("session") or []:
        if "cold_new_tokens_s" in r:
            lines.append(f"| session turn {r['turn']} ({r['prompt']:,} tokens, {r['new_tokens']} new) | warm "
                         f"{r['warm_ttft_s']} s vs the new tokens alone, cold {r['cold_new_tokens_s']} s "
                         f"({r['ratio']}x) |")
    for key, name in (("side_on", "side lane on"), ("side_off", "side lane off")):
        if key in D:
            lines.append(f"| short requests during a long one, {name} | median {D[key]['median_s']} s "
                         f"({D[key]['latency_s']}) |")
    s = D.get("speculation")
    if s:
        lines.append(f"| speculation on / off, nothing accepted | {s['on_tok_s']} / {s['off_tok_s']} tok/s "
                     f"(cost {s['cost_pct']} %) |")
    for name, p in (D.get("peer") or {}).items():
        lines.append(f"| transformers ({name}) on the same checkpoint | decode at 4K {p['decode'].get('4096')} ms/token;"
                     f" prefill {p['prefill']} tok/s; load {p['load_s']} s |")
    if D.get("skipped"):
        lines.append(f"| skipped (time budget or --skip) | {', '.join(map(str, D['skipped']))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    ap.add_argument("--ckpt", help="where the checkpoint is (or is written); default OUT/ckpt")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--max-context", type=int, default=140000)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--decode-context", type=int, default=4096, help="the prompt the decode rate is measured after")
    ap.add_argument("--ttft", default="2048,8192,32768,131072")
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--skip", default="", help="comma-separated stages to leave out")
    ap.add_argument("--server-args", default="", help="more arguments for the main server (e.g. '--spec off')")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    R = Results(out, a.budget)
    ckpt = Path(a.ckpt) if a.ckpt else out / "ckpt"
    vocab = SHAPES[a.shape]["vocab_size"]
    home = out / "home"
    gen_dev = a.device if a.device.startswith("cuda") else "cpu"
    R.put("checkpoint", write_checkpoint(ckpt, a.shape, gen_dev))
    srv = Server(ckpt, home, a.device, a.max_context, *a.server_args.split())
    servers = [srv]
    try:
        R.put("load_s", srv.wait(600))
        R.put("host_peak_at_ready", srv.peak_rss())
        R.put("health_engine", srv.health().get("engine"))
        R.put("load_host_memory", srv.health().get("info", {}).get("load_host_memory"))
        stages = [("memory", lambda: memory_stage(srv, R)),
                  ("decode", lambda: decode_stage(srv, R, vocab, a.decode_context, a.decode_tokens)),
                  ("ttft", lambda: ttft_stage(srv, R, vocab, [int(x) for x in a.ttft.split(",")
                                                              if x and int(x) < a.max_context])),
                  ("session", lambda: session_stage(srv, R, vocab)),
                  ("side_on", lambda: side_stage(srv, R, vocab, "side_on")),
                  ("memory_after", lambda: memory_stage(srv, R, "memory_after"))]
        for name, fn in stages:
            with R.stage(name, skip) as st:
                if st.run:
                    fn()
        with R.stage("speculation", skip) as st:
            if st.run:
                srv.stop()                   # one 27B server at a time fits the device
                off = Server(ckpt, home / "off", a.device, a.max_context, "--spec", "off", "--no-cache")
                servers.append(off)
                R.put("load_s_off", off.wait(600))
                spec_cost_stage(srv, off, R, vocab, a.decode_context, a.decode_tokens)
                off.stop()
        with R.stage("side_off", skip) as st:
            if st.run:
                srv.stop()
                nolane = Server(ckpt, home / "nolane", a.device, a.max_context, env={"TANDEM_SIDE_LANE": "0"})
                servers.append(nolane)
                R.put("load_s_nolane", nolane.wait(600))
                side_stage(nolane, R, vocab, "side_off")
    finally:
        for s in servers:
            s.stop()
        R.put("server_log_tail", srv.lines[-30:])
    with R.stage("peer", skip if a.peer else skip | {"peer"}) as st:
        if st.run:
            peer_stage(ckpt, R, out)
    md = report(R.data)
    (out / "serve.md").write_text(md + "\n")
    print(md)
    for k, v in R.data["errors"].items():
        print(f"==== {k}\n{v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
