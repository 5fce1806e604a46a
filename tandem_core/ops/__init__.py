"""Per-op references in plain torch, and a per-device dispatch so kernels can sit beside them.

Every op has a reference that runs on any device (``tandem_core.ops.<module>``).
A faster kernel for one device type registers beside it with
``register(name, device_type, fn)``; ``get(name, device)`` returns the kernel
registered for ``device``'s type, or the reference. References are named by
import path and imported on first use, so importing this package imports no
torch.

Ops (the reference's signature is the op's contract):

    rms_norm        x * rsqrt(mean(x^2) + eps) * w                (norm.py)
    rms_norm_1p     x * rsqrt(mean(x^2) + eps) * (1 + w)           (norm.py, Qwen's zero-centred weight)
    gated_rms_norm  rms_norm(x, w) * silu(gate)                    (norm.py)
    l2_norm         x * rsqrt(sum(x^2) + eps)                      (norm.py)
    causal_conv     depthwise causal conv with its tail state      (conv.py)
    gdn_chunk       gated delta rule, chunked (prefill)            (gdn.py)
    gdn_recurrent   gated delta rule, one token at a time (decode) (gdn.py)
    rope            rotary embedding on the leading channels        (rope.py)
    attention       new rows over cached K/V under a mask           (attention.py)
    sigmoid, silu, softplus, softmax                               (act.py, CPU-width independent)
    moe_route       a router's top-k experts and their weights     (moe.py; sigmoid or softmax scoring)
    grouped_experts the selected experts, each once over its rows  (moe.py; a MoE family's feed-forward)

Row-invariant and tree forms (speculative verify; a verified row equals the decode step's bit for bit):

    linear_rows       every row through a Linear as if alone        (rows.py; why and what was measured)
    causal_conv_tree  the short conv over a token tree              (conv.py)
    gdn_tree          the gated delta rule, each node from its parent's state (gdn.py)
    attention_tree    each node over the sequence and its ancestors  (attention.py)

A plugin adds an op of its own (a family's expert matmul, say) with ``define(name, "module:function")``: its
reference, named by import path; a device's kernel then registers beside it as for the core's ops.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["REFERENCES", "define", "register", "unregister", "get", "reference", "kernels", "names"]

REFERENCES: dict[str, str] = {
    "rms_norm": "tandem_core.ops.norm:rms_norm",
    "rms_norm_1p": "tandem_core.ops.norm:rms_norm_1p",
    "gated_rms_norm": "tandem_core.ops.norm:gated_rms_norm",
    "l2_norm": "tandem_core.ops.norm:l2_norm",
    "causal_conv": "tandem_core.ops.conv:causal_conv",
    "gdn_chunk": "tandem_core.ops.gdn:gdn_chunk",
    "gdn_recurrent": "tandem_core.ops.gdn:gdn_recurrent",
    "rope": "tandem_core.ops.rope:apply_rope",
    "attention": "tandem_core.ops.attention:attention",
    "sigmoid": "tandem_core.ops.act:sigmoid",
    "silu": "tandem_core.ops.act:silu",
    "softplus": "tandem_core.ops.act:softplus",
    "softmax": "tandem_core.ops.act:softmax",
    "linear_rows": "tandem_core.ops.rows:linear_rows",
    "causal_conv_tree": "tandem_core.ops.conv:causal_conv_tree",
    "gdn_tree": "tandem_core.ops.gdn:gdn_tree",
    "attention_tree": "tandem_core.ops.attention:attention_tree",
    "moe_route": "tandem_core.ops.moe:route",
    "grouped_experts": "tandem_core.ops.moe:grouped_experts",
}

_lock = threading.Lock()
_kernels: dict[tuple[str, str], Callable[..., Any]] = {}
_refs: dict[str, Callable[..., Any]] = {}


def names() -> list[str]:
    return sorted(REFERENCES)


def _device_type(device: Any) -> str:
    if device is None:
        return "cpu"
    if isinstance(device, str):
        return device.split(":", 1)[0]
    return str(getattr(device, "type", device))


def reference(name: str) -> Callable[..., Any]:
    """The plain-torch reference of op ``name``."""
    if name not in REFERENCES:
        raise KeyError(f"unknown op {name!r}; ops: {', '.join(names())}")
    with _lock:
        fn = _refs.get(name)
    if fn is None:
        from tandem_core.plugins import import_string

        fn = import_string(REFERENCES[name])
        with _lock:
            _refs[name] = fn
    return fn


def define(name: str, reference_path: str) -> None:
    """Add op ``name`` whose plain-torch reference is ``reference_path`` (``"module:function"``, imported on first
    use). Defining an op again with the same reference is a no-op; with another, an error naming both."""
    with _lock:
        have = REFERENCES.get(name)
        if have is not None and have != reference_path:
            raise ValueError(f"op {name!r} is already defined by {have}; cannot define it as {reference_path}")
        REFERENCES[name] = reference_path


def register(name: str, device_type: str, fn: Callable[..., Any]) -> None:
    """Use ``fn`` for op ``name`` on devices of ``device_type`` (``"cuda"``).

    ``fn`` keeps the reference's contract (signature, shapes, what it mutates)."""
    if name not in REFERENCES:
        raise KeyError(f"cannot register a kernel for unknown op {name!r}; ops: {', '.join(names())}")
    with _lock:
        _kernels[(name, device_type)] = fn


def unregister(name: str, device_type: str) -> None:
    with _lock:
        _kernels.pop((name, device_type), None)


def kernels() -> dict[tuple[str, str], Callable[..., Any]]:
    """The registered kernels, by (op, device type)."""
    with _lock:
        return dict(_kernels)


def get(name: str, device: Any = None) -> Callable[..., Any]:
    """The kernel for op ``name`` on ``device`` (a ``torch.device`` or ``"cuda:0"``), else its reference."""
    with _lock:
        fn = _kernels.get((name, _device_type(device)))
    return fn if fn is not None else reference(name)
