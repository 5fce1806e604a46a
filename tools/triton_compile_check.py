"""Compile, for an H200 (sm_90), every Triton kernel specialization a CPU run launches (a check, not a test).

The kernels' arithmetic is checked on a machine without a GPU under Triton's interpreter; what the interpreter
cannot see is whether the GPU compiler lowers them (a dot's operand layout, a shape it refuses, shared memory
beyond the device's). Two steps, in a side environment that has Triton (never the project's CPU test one):

    # 1. run any script or pytest under the interpreter, recording each kernel launch's argument types,
    #    constexpr values and launch options
    TRITON_INTERPRET=1 python tools/triton_compile_check.py record --out /tmp/specs.json -- \\
        tools/interpret_flashnext_cuda.py --ckpt /tmp/ck/text
    # 2. compile each recorded specialization for sm_90 (no GPU needed: Triton's own ptxas), without the
    #    interpreter; one line a specialization, exit 1 if any fails
    python tools/triton_compile_check.py compile /tmp/specs.json

The kernels are found again by their module and name through the modules' ``kernels()`` (every Triton module of
the core and the plugins builds its kernels there). Alignment hints are not recorded: the compile sees every
pointer as unaligned, which changes vectorisation, not what lowers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
from typing import Any

_TYPES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16", "torch.int32": "i32",
          "torch.int64": "i64", "torch.int8": "i8", "torch.uint8": "u8", "torch.bool": "i1", "torch.int16": "i16"}


def _arg_type(v: Any) -> str | None:
    if hasattr(v, "dtype") and hasattr(v, "data_ptr"):
        return "*" + _TYPES[str(v.dtype)]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return None
    raise TypeError(f"triton_compile_check: cannot type an argument of {type(v).__name__}")


def record(out: str, argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("triton_compile_check record: run with TRITON_INTERPRET=1")
        return 2
    import inspect

    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict[str, Any]] = {}
    orig = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        sig = inspect.signature(self.fn)
        params = list(sig.parameters.values())
        bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        signature, constexprs = {}, {}
        for p in params:
            v = bound.arguments.get(p.name)
            if "constexpr" in str(p.annotation):
                constexprs[p.name] = v
            else:
                signature[p.name] = _arg_type(v)
        opts = {k: v for k, v in kwargs.items() if k not in sig.parameters and k in ("num_warps", "num_stages")}
        spec = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": signature,
                "constexprs": constexprs, "options": opts}
        seen.setdefault(json.dumps(spec, sort_keys=True, default=str), spec)
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    code = 0
    try:
        if argv and argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__")
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        with open(out, "w") as f:
            json.dump(list(seen.values()), f, indent=0, default=str)
        print(f"triton_compile_check: {len(seen)} specializations recorded in {out} (the run exited {code})")
    return code


def _kernel(module: str, name: str) -> Any:
    mod = importlib.import_module(module)
    for k in mod.kernels().values():
        if getattr(getattr(k, "fn", None), "__name__", None) == name:
            return k
    raise LookupError(f"{module}.kernels() has no kernel {name}")


def compile_all(path: str, capability: int = 90) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("triton_compile_check compile: run without TRITON_INTERPRET")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    with open(path) as f:
        specs = json.load(f)
    bad = 0
    for s in specs:
        label = f"{s['module']}.{s['name']} {s['constexprs']} {s['options']}"
        try:
            k = _kernel(s["module"], s["name"])
            sig = {n: ("constexpr" if n in s["constexprs"] else s["signature"][n]) for n in k.arg_names}
            sig = {n: t for n, t in sig.items() if t is not None}
            consts = {n: v for n, v in s["constexprs"].items()}
            consts.update({n: None for n, t in s["signature"].items() if t is None})
            c = triton.compile(ASTSource(k, sig, constexprs=consts), target=target, options=dict(s["options"]))
            print(f"ok   {label}: {c.metadata.shared} B shared, {c.metadata.num_warps} warps")
        except Exception as e:                                   # every failure named, the rest still compiled
            bad += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    print(f"triton_compile_check: {len(specs) - bad} of {len(specs)} compiled for sm_{capability}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("record", "compile"):
        print(__doc__)
        return 2
    if argv[0] == "record":
        p = argparse.ArgumentParser(prog="triton_compile_check record")
        p.add_argument("--out", required=True)
        rest = argv[1:]
        split = rest.index("--") if "--" in rest else len(rest)
        a = p.parse_args(rest[:split])
        return record(a.out, rest[split + 1:])
    p = argparse.ArgumentParser(prog="triton_compile_check compile")
    p.add_argument("specs")
    p.add_argument("--capability", type=int, default=90)
    a = p.parse_args(argv[1:])
    return compile_all(a.specs, a.capability)


if __name__ == "__main__":
    sys.exit(main())
