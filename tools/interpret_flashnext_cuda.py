"""FlashNextCudaRunner's Triton path on the CPU under Triton's interpreter, against its torch form.

The kernels' checks on a machine without a GPU: run with ``TRITON_INTERPRET=1`` in an environment that has
Triton (a side venv: torch, triton, numpy < 2.3 for Triton 3.6's interpreter, pyyaml, pluggy; never the
project's CPU test environment). ``--ckpt`` is a tiny ``qwen4_exp`` checkpoint (the flashnext tests write them:
``conftest_flashnext.build_text(path)``). It checks:

- the plugin's kernels (``triton_qsa``) against their torch references, a gathered-attention row alone equal to
  the same row in a call of several;
- the runner with ``unsupported`` forced to None on CPU tensors (every Triton kernel the CUDA path launches:
  the skinny matmul, conv_tree, gdn_tree, gated_rms_norm, conv_commit, qk_post, triton_moe, the plugin's): the
  prefill and decode logits against the torch form (bf16 both: within rounding, and a top-k selection flipped by
  a rounding moves a row further: ``--every-block`` selects every block), a random tree's rows equal to plain
  decode rows bit for bit and the state after its commit equal to plain decode's.

Triton 3.6's interpreter multiplies bf16 operands of ``tl.dot`` as their raw uint16 bits (the interpreter's
bug, not the GPU path's): the script widens them to fp32 first, exactly.

    TRITON_INTERPRET=1 PYTHONPATH=.:plugins/flashnext .venv-triton/bin/python tools/interpret_flashnext_cuda.py \\
        --ckpt /tmp/ck/text
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch


def _widen_bf16_dots() -> None:
    import triton.language as tl
    from triton.runtime import interpreter as interp

    dot = interp.InterpreterBuilder.create_dot

    def wide(t: object) -> object:
        if t.dtype == tl.bfloat16:                                                  # type: ignore[attr-defined]
            return interp.TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32)  # type: ignore
        return t

    interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, wide(a), wide(b), d, *rest)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def kernels() -> list[str]:
    from tandem_flashnext import triton_qsa as tq

    bad: list[str] = []

    def check(name: str, err: float, tol: float = 2e-2) -> None:
        print(f"{name}: {err:.2e}")
        if not err <= tol:
            bad.append(f"{name} {err:.2e}")

    torch.manual_seed(0)
    x = torch.randn(5, 3 * 40).bfloat16()
    wn = torch.randn(120) * 0.1
    check("group_norm1p", rel(tq.group_norm1p(x, wn, 1e-6, 3), tq.group_norm1p_ref(x, wn, 1e-6, 3)))
    q = torch.randn(4, 3, 32).bfloat16()
    keys = torch.randn(70 * 4, 32).bfloat16()[3::4]
    nv = torch.tensor([0, 5, 70, 33], dtype=torch.int32)
    check("head_scores (shared keys)", rel(tq.head_scores(q, keys, nv, math.sqrt(32), True),
                                           tq.head_scores_ref(q, keys, nv, math.sqrt(32), True)), 1e-5)
    kr = torch.randn(4, 3, 32).bfloat16()
    n4 = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    check("head_scores (a row's keys)", rel(tq.head_scores(q, kr, n4, 2.0, False), tq.head_scores_ref(q, kr, n4, 2.0,
                                                                                                      False)), 1e-5)
    for hq, hkv, D, S, R, M in [(6, 2, 32, 90, 5, 43), (24, 2, 256, 300, 2, 140)]:
        qa = torch.randn(R, hq * D).bfloat16()
        K, V = torch.randn(hkv, S, D).bfloat16(), torch.randn(hkv, S, D).bfloat16()
        slots = torch.randint(0, S, (R, M), dtype=torch.int32)
        slots[1, 10:] = -1
        slots[0, ::3] = -1
        parts = tq.AttnParts(8, hq, hkv, D, torch.device("cpu"))
        a = tq.gathered_attention(qa, K, V, slots, D ** -0.5, hkv, parts)
        check(f"gathered_attention Hq {hq} D {D}", rel(a, tq.gathered_attention_ref(qa, K, V, slots, D ** -0.5, hkv)))
        one = tq.gathered_attention(qa[1:2].clone(), K, V, slots[1:2].clone(), D ** -0.5, hkv, parts)
        if not torch.equal(one[0], a[1]):
            bad.append("a gathered row depends on its call")
    parts3 = torch.randn(4, 5, 70)
    for kind in ("silu", "sigmoid"):
        check(f"act {kind}", rel(tq.act(parts3, 0.25, 2.0, kind), tq.act_ref(parts3, 0.25, 2.0, kind)))
    up, nrm = torch.randn(5, 120).bfloat16(), torch.randn(5, 120).bfloat16()
    check("hyper_combine", rel(tq.hyper_combine(up, nrm, 3), tq.hyper_combine_ref(up, nrm, 3)))
    xx, dd, ww = torch.randn(5, 120).bfloat16(), torch.randn(5, 40).bfloat16(), torch.rand(5, 3).bfloat16()
    check("inject_add", rel(tq.inject_add(xx.clone(), dd, ww), tq.inject_add_ref(xx, dd, ww)))
    dp = torch.randn(2, 5, 40)
    check("inject_add (split partials)", rel(tq.inject_add(xx.clone(), dp, ww), tq.inject_add_ref(xx, dp, ww)))
    # the attended slots: a random tree of 24 nodes on 37 committed tokens, blocks of 4, 6 picks a row
    from tandem_flashnext.cuda_runner import tree_tables

    rng = random.Random(1)
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, 24)]
    depth, anc_l = tree_tables(parents)
    W, L, r, NB = 24, 37, 4, 20
    anc = torch.zeros(W, W, dtype=torch.int32)
    for i, a in enumerate(anc_l):
        anc[i, :len(a)] = torch.tensor(a, dtype=torch.int32)
    pos = torch.tensor([L + d for d in depth])
    head = torch.tensor([L, W], dtype=torch.int32)
    topv = torch.randint(-3, 100, (W, 6))
    topi = torch.randint(0, NB + 7, (W, 6))
    got, want = tq.slots(topv, topi, head, pos, anc, NB, r), tq.slots_ref(topv, topi, head, pos, anc, NB, r)
    print(f"slots equal their reference: {torch.equal(got, want)}")
    if not torch.equal(got, want):
        bad.append("slots")
    return bad


def runner(path: str, every_block: bool) -> list[str]:
    from tandem_flashnext import cuda_runner as cr
    from tandem_flashnext.config import read_config
    from tandem_flashnext.weights import load_weights, open_checkpoint

    from tandem_core.engine import SequenceEngine
    from tandem_core.testing.trees import assert_same_state, path_to, plain_rows_of_tree, random_tree

    cfg = read_config(json.load(open(os.path.join(path, "config.json"))))
    if every_block:
        cfg = dataclasses.replace(cfg, indexer_budget=1024)
    w_ref = load_weights(open_checkpoint(path, cfg), cfg, "bf16")
    w_tri = load_weights(open_checkpoint(path, cfg), cfg, "bf16")
    ref = SequenceEngine(cr.FlashNextCudaRunner(cfg, w_ref, max_context=64, max_tree=8, graphs=False), name="x")
    real = cr.unsupported
    cr.unsupported = lambda cfg, w: None                      # the Triton path on CPU tensors, interpreted
    try:
        def tri() -> SequenceEngine:
            return SequenceEngine(cr.FlashNextCudaRunner(cfg, w_tri, max_context=64, max_tree=8, graphs=False),
                                  name="x")

        eng = tri()
        assert eng.runner._triton and not ref.runner._triton
        ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(5))
        ids[7::17] = cfg.eos_token_id
        t0 = time.time()
        print(f"prefill, the CUDA forms against the torch form: {rel(eng.forward(ids[:20]), ref.forward(ids[:20])):.2e}")
        errs = [rel(eng.forward(torch.tensor([t])), ref.forward(torch.tensor([t]))) for t in ids[20:30].tolist()]
        print(f"decode, 10 tokens: max {max(errs):.2e} ({time.time() - t0:.0f} s)")
        twin = tri()
        twin.forward(ids[:22])
        base = twin.state.clone()
        tokens, parents = random_tree(random.Random(3), 8, cfg.vocab_size)
        want, _, states = plain_rows_of_tree(twin, base, tokens, parents)
        eng = tri()
        eng.state.restore(base)
        out = eng.forward_tree(torch.tensor(tokens), torch.tensor(parents))
        bad = [] if all(torch.equal(out.logits[i], want[i]) for i in range(8)) else ["tree rows differ from decode"]
        leaf = max(range(8), key=lambda i: len(path_to(parents, i)))
        eng.commit_tree(path_to(parents, leaf))
        assert_same_state(eng.state, states[leaf])
        print(f"tree rows equal decode rows: {not bad}; the state after the commit equals plain decode's: True")
        return bad
    finally:
        cr.unsupported = real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="a tiny qwen4_exp checkpoint directory")
    ap.add_argument("--every-block", action="store_true", help="a budget that selects every block")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    _widen_bf16_dots()
    bad = kernels() + runner(a.ckpt, a.every_block)
    print("FAILED: " + "; ".join(bad) if bad else "all checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
