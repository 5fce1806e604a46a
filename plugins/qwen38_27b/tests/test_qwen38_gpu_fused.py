"""The CUDA graph runner's fused kernels (``CudaRunner(fuse=...)``, ``triton_fused_mm``) change no bit.

Two ``CudaRunner``s over the same random fused weights (a small Qwen3.8 shape: three Gated DeltaNet layers and
one attention layer), one with every fusion at every width, one with none:

- their decode logits, their verify logits at widths 1..64 (chains and branching trees) and the state after
  each step and commit (``S``, the conv tails, ``K``/``V``, the kept conv rows) are equal bit for bit;
- with the default fusions (fused decode and narrow verifies, the unfused pair for wide ones) verified rows
  equal decode rows bit for bit, and the state after a commit equals plain decode's.

On a CUDA device the steps are the captured graphs. Skipped without CUDA and Triton; with
``TRITON_INTERPRET=1`` (Triton installed) the same tests run the eager steps on the CPU in the interpreter.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tandem_core.testing.kernels import triton_interpreting

INTERPRET = triton_interpreting()
CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not (CUDA or (INTERPRET and importlib.util.find_spec("triton") is not None)),
                                reason="needs a CUDA device and Triton (or TRITON_INTERPRET=1 with Triton)")
DEV = "cuda" if CUDA else "cpu"
VOCAB = 320
SHAPE = dict(
    model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
    linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
    full_attention_interval=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
# the interpreter is slow: fewer and narrower widths there (still fused and unfused ones, and a padded width)
WIDTHS = (1, 2, 4, 8, 16, 24, 32, 48, 64) if CUDA else (1, 4, 16, 32)
TREES = (1, 3, 16, 40, 64) if CUDA else (1, 3, 16, 30)
MAX_CONTEXT = 512


def random_fused(cfg, seed: int = 0):
    from tandem_qwen38.cuda_graphs import AttnW, FusedWeights, GdnW, LayerW

    g = torch.Generator().manual_seed(seed)

    def mat(n, k):
        return (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16().to(DEV).contiguous()

    def vec(n, s=0.1):
        return (torch.randn(n, generator=g) * s).to(DEV)

    H, I = cfg.hidden_size, cfg.intermediate_size
    layers = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_linear(i):
            conv = vec(cfg.conv_dim * cfg.linear_conv_kernel_dim, 0.5).view(cfg.conv_dim, -1).contiguous()
            mixer = GdnW(mat(cfg.conv_dim + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads, H), conv,
                         vec(cfg.linear_value_head_dim) + 1.0, mat(H, cfg.gdn_value_dim))
        else:
            D = cfg.head_dim
            mixer = AttnW(mat(2 * cfg.num_attention_heads * D + 2 * cfg.num_key_value_heads * D, H), vec(D),
                          vec(D), mat(H, cfg.num_attention_heads * D))
        layers.append(LayerW(vec(H), vec(H), mixer, mat(2 * I, H), mat(H, I)))
    n_gdn, hv = len(cfg.linear_layers), cfg.linear_num_value_heads
    A_log = torch.log(torch.rand(n_gdn, hv, generator=g) * 15 + 1).to(DEV)
    dt_bias = (torch.randn(n_gdn, hv, generator=g) * 0.5).to(DEV)
    embed = torch.randn(VOCAB, H, generator=g).bfloat16().to(DEV)
    return FusedWeights(embed, mat(VOCAB, H), vec(H), layers, A_log, dt_bias)


def make_runner(cfg, fw, **kw):
    from tandem_qwen38.cuda_graphs import CudaRunner
    from tandem_qwen38.model import allocate_state

    sections, views = allocate_state(cfg, torch.device(DEV), torch.bfloat16, MAX_CONTEXT + WIDTHS[-1])
    run = CudaRunner(cfg, fw, sections["gdn.S"], sections["gdn.conv"], views["K"].tensor, views["V"].tensor,
                     max_context=MAX_CONTEXT + WIDTHS[-1], widths=WIDTHS, prefill_chunk=64, pdl=False, **kw)
    if CUDA:
        with torch.no_grad():
            run.capture()
    return run


def state(run) -> dict[str, torch.Tensor]:
    L = run.length
    return {"S": run.S.clone(), "conv": run.conv.clone(), "K": run.K[:, :, :L].clone(),
            "V": run.V[:, :, :L].clone(), "length": torch.tensor(L)}


def restore(run, st: dict[str, torch.Tensor]) -> None:
    run.S.copy_(st["S"])
    run.conv.copy_(st["conv"])
    L = int(st["length"])
    run.K[:, :, :L].copy_(st["K"])
    run.V[:, :, :L].copy_(st["V"])
    run.length = L
    run._tree_n = 0


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def cfg():
    from tandem_qwen38.config import read_config

    return read_config(SHAPE)


@pytest.fixture(scope="module")
def fw(cfg):
    return random_fused(cfg)


def _tree(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    tokens, parents = [], []
    for i in range(n):
        parents.append(-1 if i == 0 else rng.choice([-1, i - 1, i - 1, rng.randrange(i)]))
        tokens.append(rng.randrange(VOCAB))
    return tokens, parents


@torch.no_grad()
def test_every_fusion_at_every_width_changes_no_bit(cfg, fw):
    plain = make_runner(cfg, fw, fuse=False)
    fused = make_runner(cfg, fw, fuse=True, fuse_rows=WIDTHS[-1], fuse_conv_rows=WIDTHS[-1])
    assert (plain.fuse_rows, plain.fuse_conv_rows) == (0, 0)
    rng = random.Random(5)
    # decode from the empty sequence: every step's logits and state
    for j in range(6):
        tok = rng.randrange(VOCAB)
        a, b = plain.decode(tok).clone(), fused.decode(tok).clone()
        assert torch.equal(a, b), f"decode step {j}"
        assert differ(state(plain), state(fused)) == [], f"state after decode step {j}"
    # verify trees of each width (chains and branching), then commit a root-to-leaf path
    for n in TREES:
        for kind in ("chain", "tree"):
            tokens, parents = ([rng.randrange(VOCAB) for _ in range(n)], list(range(-1, n - 1))) \
                if kind == "chain" else _tree(rng, n)
            a, b = plain.verify(tokens, parents).clone(), fused.verify(tokens, parents).clone()
            assert torch.equal(a, b), f"verify {kind} of {n}"
            assert torch.equal(plain.qkvc[:, :n], fused.qkvc[:, :n]), f"conv rows of the {kind} of {n}"
        leaf = n - 1
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        ka, kb = plain.commit(path, keep=True), fused.commit(path, keep=True)
        assert torch.equal(ka.qkv, kb.qkv) and torch.equal(ka.proj, kb.proj), f"kept rows after the {n} tree"
        assert differ(state(plain), state(fused)) == [], f"state after committing the {n} tree"


@torch.no_grad()
def test_verified_rows_equal_decode_rows_with_the_default_fusions(cfg, fw):
    from tandem_qwen38 import cuda_graphs

    run = make_runner(cfg, fw, fuse=True)
    assert (run.fuse_rows, run.fuse_conv_rows) == (cuda_graphs.FUSE_ROWS, cuda_graphs.FUSE_CONV_ROWS)
    rng = random.Random(9)
    for _ in range(5):                                       # some context first
        run.decode(rng.randrange(VOCAB))
    start = state(run)
    toks = [rng.randrange(VOCAB) for _ in range(10)]
    rows, states = [], []
    for t in toks:
        rows.append(run.decode(t)[0].clone())
        states.append(state(run))
    # a chain of 10 (a padded width 16: the fused kernels) and a tree of the widest width (the pair): every
    # path row equal
    restore(run, start)
    out = run.verify(toks, list(range(-1, 9))).clone()
    for j in range(10):
        assert torch.equal(out[j], rows[j]), f"chain row {j}"
    run.commit(list(range(10)))
    assert differ(state(run), states[-1]) == []
    restore(run, start)
    tokens, parents, where = [], [], []
    prev = -1
    for j in range(10):
        tokens.append(toks[j])
        parents.append(prev)
        where.append(len(tokens) - 1)
        prev = len(tokens) - 1
        for k in range(5 if CUDA else 2):
            tokens.append((toks[j] + 1 + k) % VOCAB)
            parents.append(prev if k % 2 else parents[prev])
    tokens += [7] * (WIDTHS[-1] - len(tokens))
    parents += [-1] * (WIDTHS[-1] - len(parents))
    out = run.verify(tokens, parents).clone()
    for j in range(10):
        assert torch.equal(out[where[j]], rows[j]), f"tree row {j}"
    run.commit(where[:4])
    assert differ(state(run), states[3]) == []
    assert torch.equal(run.decode(toks[4])[0], rows[4])
    assert differ(state(run), states[4]) == []
