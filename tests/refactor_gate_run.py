"""The refactor gate's run: the exact bytes of a tiny qwen3_5 engine's prefill and decode, hashed.

    python tests/refactor_gate_run.py            print the hashes (run pinned, in a child process)
    python tests/refactor_gate_run.py --record   re-record tests/fixtures/refactor_gate.json

The tiny model is built from a seed here (no checkpoint, no transformers): the
config goes through the plugin's strict reader, the tensors through its
``build_weights``, the run through the core's ``SequenceEngine`` over the plugin's
reference runner. What is hashed: every logit
and the post-norm hidden rows of a chunked prefill, then of two decode steps,
and every byte of the state (``gdn.S``, ``gdn.conv`` whole; ``K``, ``V`` up to the
length) after each; then a block verify and its commit, a rollback of two pending
tokens, and a tree verify (two roots, a branch) with the commit of one path.

The child runs with one thread and the environment that pins kernel choice, so
the bytes do not depend on the CPU's vector width: ``ATEN_CPU_CAPABILITY=default``
(ATen's element-wise and reduction kernels take their baseline path),
``MKL_CBWR=COMPATIBLE`` (MKL, which computes every fp32 matmul and triangular
solve here, takes its CPU-independent path), ``OMP_NUM_THREADS=1``. The engine
calls no oneDNN primitive on this path (its conv is summed tap by tap). The
child's environment is built from scratch, so no outside switch leaks in.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "refactor_gate.json"
PLUGIN_SRC = ROOT / "plugins" / "qwen38_27b"

PINNED = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_DYNAMIC": "FALSE",
    "TANDEM_DISABLE_ENTRYPOINTS": "1",   # the core's default weight formats only
    "TANDEM_PLUGINS": "",
    "PYTHONHASHSEED": "0",
}

SEED = 20250611
RAW_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
}
PROMPT_LEN = 21
PREFILL_CHUNK = 8
GDN_CHUNK = 8
DECODES = 2


def _digest(t) -> str:
    import torch

    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype} {list(t.shape)}\n".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run() -> dict[str, str]:
    """The gate's hashes (call in a pinned process)."""
    import numpy as np
    import torch

    for src in (ROOT, PLUGIN_SRC):  # the checkout's sources, installed or not
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
    from tandem_qwen38.config import read_config
    from tandem_qwen38.serving import build_engine
    from tandem_qwen38.weights import build_weights, expected_tensors

    torch.set_num_threads(1)
    cfg = read_config(RAW_CONFIG)
    # numpy's generator, not torch.randn: torch's normal sampler takes a different path on each vector width
    rng = np.random.default_rng(SEED)
    tensors = {}
    for name, exp in sorted(expected_tensors(cfg).items()):
        r = torch.from_numpy(rng.standard_normal(exp.shape, dtype=np.float32))
        if name.endswith("A_log"):
            r = r * 0.5 - 1.0
        elif len(exp.shape) >= 2:
            r = r / exp.shape[-1] ** 0.5
        else:
            r = r * 0.2
        tensors[name] = r
    weights = build_weights(tensors, cfg, "fp32", identity="refactor-gate")
    eng = build_engine(cfg, weights, 64, PREFILL_CHUNK, gdn_chunk=GDN_CHUNK)
    ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, PROMPT_LEN))

    out: dict[str, str] = {}

    def record(tag: str, logits) -> None:
        out[f"{tag}.logits"] = _digest(logits)
        out[f"{tag}.hidden"] = _digest(eng.hidden_post_norm())
        st = eng.state
        for k, v in sorted(st.sections.items()):
            out[f"{tag}.state.{k}"] = _digest(v)
        for k, v in sorted(st.views.items()):
            out[f"{tag}.state.{k}"] = _digest(v.head(st.length))
        out[f"{tag}.length"] = str(st.length)

    with torch.no_grad():
        logits = eng.forward(ids, all_logits=True)
        record("prefill", logits)
        for d in range(DECODES):
            logits = eng.forward(eng.picks(logits[-1:]))
            record(f"decode{d}", logits)
        # speculation's verbs: a block verify, a rollback inside it, a tree verify and its commit
        nxt = int(eng.picks(logits[-1:])[0])
        block = torch.tensor([nxt, 5, 17, 33], dtype=torch.long)
        out["block.logits"] = _digest(eng.forward_block(block).logits)
        eng.commit_tree([0, 1, 2, 3])
        record("block_commit", eng.forward_block(torch.tensor([7], dtype=torch.long)).logits)
        eng.discard_pending()
        eng.trim_pending(2)
        out["rollback.length"] = str(eng.state.length)
        eng.settle()
        tree = torch.tensor([9, 4, 11, 4, 2, 8], dtype=torch.long)
        parents = torch.tensor([-1, 0, 0, 1, 3, -1], dtype=torch.long)
        tree_logits = eng.forward_tree(tree, parents).logits
        eng.commit_tree([0, 1, 3, 4])
        record("tree_commit", tree_logits)
        eng.settle()
    return out


def child_env(capability: str = "default") -> dict[str, str]:
    return {**PINNED, "ATEN_CPU_CAPABILITY": capability}


def run_pinned(capability: str = "default") -> dict[str, str]:
    """Run the gate in a child process with the pinned environment; returns its hashes."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"],
                          env=child_env(capability), capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"refactor gate child failed (ATEN_CPU_CAPABILITY={capability}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    if "--child" in argv:
        print(json.dumps(run(), sort_keys=True))
        return 0
    hashes = run_pinned()
    if "--record" in argv:
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        about = ("tests/refactor_gate_run.py: sha256 of every logit and state byte of a tiny qwen3_5 "
                 "engine's prefill, decodes, block verify, rollback, tree verify and commits")
        FIXTURE.write_text(json.dumps({"about": about, "hashes": hashes}, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(hashes)} hashes in {FIXTURE.relative_to(ROOT)}")
    else:
        print(json.dumps(hashes, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
