"""Reading a ``.gguf`` file with the ``gguf`` package: metadata, tensors, tokenizer and chat template.

The file is memory-mapped by ``gguf.GGUFReader``; a tensor's ``data`` is a view
of the mapping (nothing is read until it is touched). GGML lists a tensor's
dimensions innermost first; ``GGUFTensor.shape`` is in torch order instead
(``[N, K]`` for a weight that maps K inputs to N outputs).

The tokenizer is rebuilt from the ``tokenizer.ggml.*`` metadata as a
``tokenizers.Tokenizer`` (byte-level BPE for ``tokenizer.ggml.model = gpt2``),
with the pre-tokenizer llama.cpp uses for the file's ``tokenizer.ggml.pre``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EOG_TOKENS",
    "PRE_TOKENIZERS",
    "GGUFError",
    "GGUFFile",
    "GGUFTensor",
    "TokenizerSpec",
    "build_tokenizer",
    "stop_ids",
]


class GGUFError(ValueError):
    """A GGUF file that cannot be read or that says something this plugin does not implement."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. ``data``: the raw array (uint8 rows for block formats), a view of the
    mapping."""

    name: str
    qtype: str  # GGML type name: "F32", "F16", "BF16", "Q8_0", "Q4_1", ...
    shape: tuple[int, ...]  # torch order: [N, K] for a matrix, [K] for a vector
    nbytes: int
    data: np.ndarray


@dataclass(frozen=True)
class TokenizerSpec:
    """What ``tokenizer.ggml.*`` says about the tokenizer."""

    model: str
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool


# llama.cpp's token types (llama_token_type)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# Control tokens that end a turn for whichever model carries them (llama.cpp marks the same texts
# as end-of-generation when the metadata names no eot id).
EOG_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<|eom_id|>")


class GGUFFile:
    """A memory-mapped ``.gguf`` file."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            self._reader = GGUFReader(str(self.path), "r")
        except Exception as exc:  # the reader raises ValueError/IndexError on a damaged file
            raise GGUFError(
                f"{self.path.name}: not a readable GGUF file ({type(exc).__name__}: {exc})"
            ) from exc
        self._meta: dict[str, Any] | None = None
        self._tensors: dict[str, GGUFTensor] | None = None

    # -- metadata -------------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        """Every key-value pair except the ``GGUF.*`` header fields and the tokenizer's big arrays."""
        if self._meta is None:
            big = {
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges",
                "tokenizer.ggml.scores",
            }
            self._meta = {
                k: _contents(f)
                for k, f in self._reader.fields.items()
                if not k.startswith("GGUF.") and k not in big
            }
        return self._meta

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path.name}: no general.architecture")
        return arch

    def arch_metadata(self) -> dict[str, Any]:
        """The ``<architecture>.*`` keys with the prefix taken off (``block_count``, ``rope.freq_base``,
        ...)."""
        pre = self.architecture + "."
        return {k[len(pre) :]: v for k, v in self.metadata.items() if k.startswith(pre)}

    def array(self, key: str) -> list[Any] | None:
        f = self._reader.fields.get(key)
        return None if f is None else list(_contents(f))

    # -- tensors --------------------------------------------------------------------------------
    @property
    def tensors(self) -> dict[str, GGUFTensor]:
        if self._tensors is None:
            out: dict[str, GGUFTensor] = {}
            for t in self._reader.tensors:
                shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
                out[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, int(t.n_bytes), t.data)
            self._tensors = out
        return self._tensors

    # -- tokenizer ------------------------------------------------------------------------------
    def tokenizer_spec(self) -> TokenizerSpec:
        tokens = self.array("tokenizer.ggml.tokens")
        model = self.get("tokenizer.ggml.model")
        if tokens is None or model is None:
            raise GGUFError(f"{self.path.name}: no tokenizer in the metadata (tokenizer.ggml.model/tokens)")
        types = self.array("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise GGUFError(
                f"{self.path.name}: tokenizer.ggml.token_type has {len(types)} entries "
                f"for {len(tokens)} tokens"
            )

        def opt_id(key: str) -> int | None:
            v = self.get(f"tokenizer.ggml.{key}")
            return None if v is None else int(v)

        return TokenizerSpec(
            model=str(model),
            pre=self.get("tokenizer.ggml.pre"),
            tokens=tuple(tokens),
            token_types=tuple(int(t) for t in types),
            merges=tuple(self.array("tokenizer.ggml.merges") or ()),
            bos_id=opt_id("bos_token_id"),
            eos_id=opt_id("eos_token_id"),
            eot_id=opt_id("eot_token_id"),
            eom_id=opt_id("eom_token_id"),
            unk_id=opt_id("unknown_token_id"),
            pad_id=opt_id("padding_token_id"),
            add_bos=bool(self.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(self.get("tokenizer.ggml.add_eos_token", False)),
        )

    @property
    def chat_template(self) -> str | None:
        t = self.get("tokenizer.chat_template")
        return t if isinstance(t, str) else None


def _contents(field: Any) -> Any:
    v = field.contents()
    if isinstance(v, np.generic):
        return v.item()
    return v


# -- the tokenizer ------------------------------------------------------------------------------

# The split expressions llama.cpp applies before byte-level BPE, by ``tokenizer.ggml.pre``.
_GPT2 = None  # the ByteLevel pre-tokenizer's own expression
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (splits applied first, each isolating its matches; then ByteLevel with or without the GPT-2
# expression)
PRE_TOKENIZERS: Mapping[str, tuple[tuple[str, ...], bool]] = {
    "default": ((), True),
    "gpt2": ((), True),
    "smollm": ((r"\p{N}",), True),  # every number code point alone, then GPT-2's expression
    "llama-bpe": ((_LLAMA3,), False),
    "llama3": ((_LLAMA3,), False),
    "qwen2": ((_QWEN2,), False),
}


def build_tokenizer(spec: TokenizerSpec, where: str = "GGUF") -> Any:
    """A ``tokenizers.Tokenizer`` equal to the one the metadata describes (byte-level BPE only)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if spec.model != "gpt2":
        raise GGUFError(
            f"{where}: tokenizer.ggml.model {spec.model!r} is not supported "
            f"(tandem-llama reads byte-level BPE, 'gpt2')"
        )
    pre = spec.pre or "default"
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            f"{where}: tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(PRE_TOKENIZERS)}"
        )
    vocab: dict[str, int] = {}
    for i, tok in enumerate(spec.tokens):
        vocab.setdefault(tok, i)
    merges = []
    for n, m in enumerate(spec.merges):
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"{where}: tokenizer.ggml.merges[{n}] = {m!r} is not 'left right'")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    splits, use_regex = PRE_TOKENIZERS[pre]
    steps: list[Any] = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(spec.tokens, spec.token_types)
        if ty == TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(spec.tokens, spec.token_types)
        if ty == TOKEN_USER_DEFINED
    ]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    single, pair, specials = "$A:0", "$A:0 $B:1", []
    if spec.add_bos and spec.bos_id is not None:
        bos = spec.tokens[spec.bos_id]
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        specials.append((bos, spec.bos_id))
    if spec.add_eos and spec.eos_id is not None:
        eos = spec.tokens[spec.eos_id]
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        specials.append((eos, spec.eos_id))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return tok


def stop_ids(spec: TokenizerSpec) -> tuple[int, ...]:
    """Token ids that end a turn: eos, eot and eom from the metadata, and the control tokens in
    ``EOG_TOKENS``."""
    ids = [i for i in (spec.eos_id, spec.eot_id, spec.eom_id) if i is not None]
    ids += [
        i
        for i, (t, ty) in enumerate(zip(spec.tokens, spec.token_types))
        if ty == TOKEN_CONTROL and t in EOG_TOKENS
    ]
    return tuple(dict.fromkeys(ids))
