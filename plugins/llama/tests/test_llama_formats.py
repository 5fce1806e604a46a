"""tandem-llama's GGML weight formats: dequantisation equals ``gguf.quants.dequantize`` bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tandem_core.linear import Linear, make_linear
from tandem_core.plugins import load_plugins, plugin_manager, register_plugin


@pytest.fixture(scope="module", autouse=True)
def _llama_plugin():
    from tandem_llama import plugin

    load_plugins()
    pm = plugin_manager()
    if not pm.is_registered(plugin) and pm.get_plugin("llama") is None:
        register_plugin(plugin, "llama")
    yield


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3.0, (n, 1))).astype(np.float32)
    w[0, :32] = 0.0  # a block of zeros (scale 0)
    w[1, :32] = 0.75  # a constant block
    w[2, 32:64] = -rng.uniform(0, 1e-3, 32).astype(np.float32)  # tiny negatives
    w[3, :] = np.float32(65000.0) * np.sign(rng.standard_normal(k)).astype(np.float32)  # near fp16's top
    return w


CASES = {"ggml.q4_1": Q.Q4_1, "ggml.q8_0": Q.Q8_0, "ggml.f16": Q.F16, "ggml.bf16": Q.BF16, "ggml.f32": Q.F32}


def _raw(fmt: str, w: np.ndarray) -> np.ndarray:
    return quantize(w, CASES[fmt])


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "lean"])
@pytest.mark.parametrize("fmt", list(CASES))
def test_dequantise_equals_gguf_bit_for_bit(fmt, dense):
    w = _weights(48, 160, seed=len(fmt))
    raw = _raw(fmt, w)
    want = torch.from_numpy(np.ascontiguousarray(dequantize(raw, CASES[fmt]).reshape(48, 160)))
    lin = make_linear(fmt, raw, dense=dense)  # through the registered factory
    assert isinstance(lin, Linear)
    assert lin.shape == (48, 160)
    got = lin.dense()
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), fmt  # the bits, NaN-safe
    ids = torch.tensor([5, 0, 47, 5])
    assert torch.equal(lin.rows(ids).view(torch.int32), want[ids].view(torch.int32))


@pytest.mark.parametrize("fmt", list(CASES))
def test_matmul_and_nbytes(fmt):
    w = _weights(300, 96, seed=7)
    raw = _raw(fmt, w)
    dense, lean = make_linear(fmt, raw, dense=True), make_linear(fmt, raw, dense=False)
    x = torch.randn(5, 96)
    want = x @ dense.dense().T
    torch.testing.assert_close(dense.matmul(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lean.matmul(x), want, rtol=1e-5, atol=1e-5)
    assert dense.matmul(x[:1]).shape == (1, 300)
    stored = raw.nbytes
    assert lean.nbytes == lean.stored_nbytes == stored  # lean: reads the quantised rows
    assert dense.nbytes == 300 * 96 * 4 and dense.stored_nbytes == stored


def test_lean_matmul_runs_in_row_chunks(monkeypatch):
    from tandem_llama import formats

    monkeypatch.setattr(formats, "_CHUNK_ELEMS", 64 * 5)  # 5 rows of K=64 at a time
    raw = _raw("ggml.q4_1", _weights(23, 64, seed=3))
    lean = formats.Q4_1Weight(raw, dense=False)
    x = torch.randn(3, 64)
    torch.testing.assert_close(lean.matmul(x), x @ lean.dense().T, rtol=1e-5, atol=1e-5)


def test_real_block_layout_q4_1():
    """One hand-made Q4_1 block: d=0.5, m=-1, nibbles 0..15 low then high."""
    from tandem_llama import formats

    block = np.zeros(20, np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    block[2:4] = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)
    block[4:] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    got = formats.Q4_1Weight(block.reshape(1, 20)).dense()[0]
    want = np.concatenate([np.arange(16), np.arange(15, -1, -1)]).astype(np.float32) * 0.5 - 1.0
    assert got.tolist() == want.tolist()
    assert got.tolist() == dequantize(block.reshape(1, 20), Q.Q4_1).reshape(-1).tolist()


def test_stacking_rows_is_exact():
    from tandem_llama.formats import concat_rows

    a = make_linear("ggml.q4_1", _raw("ggml.q4_1", _weights(8, 64, 1)), dense=False)
    b = make_linear("ggml.f16", _raw("ggml.f16", _weights(4, 64, 2)), dense=False)
    for dense in (True, False):
        s = concat_rows([a, b], dense=dense)
        assert s.shape == (12, 64)
        assert torch.equal(s.dense(), torch.cat([a.dense(), b.dense()]))


def test_bad_raw_data_is_refused():
    with pytest.raises(ValueError, match="ggml.q4_1"):
        make_linear("ggml.q4_1", np.zeros((2, 21), np.uint8))
    with pytest.raises(ValueError, match="ggml.f16"):
        make_linear("ggml.f16", np.zeros((2, 8), np.float32))
