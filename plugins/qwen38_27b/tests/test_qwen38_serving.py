"""The qwen38 plugin's registration and ``serve``: what the server gets for a tiny checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest_qwen38 import PLUGIN_SRC, prompt, qwen38_ckpts  # noqa: F401  (fixture)

from tandem_core.plugins import register_plugin, unregister_plugin
from tandem_core.registry import architecture, architectures
from tandem_core.serving import ServeArgs, ServeContext, Served
from tandem_core.settings import SETTINGS
from tandem_qwen38 import plugin, serving
from tandem_qwen38.weights import expected_tensors


@pytest.fixture
def registered():
    """The plugin's hooks, whether or not its distribution is installed."""
    added = "qwen3_5" not in architectures()
    if added:
        register_plugin(plugin, "qwen38-test")
    yield
    if added:
        unregister_plugin("qwen38-test")


class Recorder(ServeContext):
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.progressed: list[tuple[int, int, str]] = []
        super().__init__(log=self.lines.append, progress=lambda d, t, w: self.progressed.append((d, t, w)))


def test_importing_the_plugin_module_imports_no_torch():
    code = ("import sys; import tandem_qwen38.plugin as p; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(p.ARCH.name)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=str(PLUGIN_SRC))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "qwen3_5"


def test_the_architecture_and_setting_are_registered(registered, qwen38_ckpts):
    for ck in (qwen38_ckpts.text, qwen38_ckpts.vl):
        arch = architecture(ck.raw_config)
        assert arch.name == "qwen3_5" and arch.package == "tandem-qwen38"
        assert arch.load("serve") is serving.serve
        assert arch.read_config(ck.raw_config).num_hidden_layers == 4
    assert SETTINGS.get("QWEN38_PREFILL_CHUNK") == 0                       # by device
    assert serving.prefill_chunk_for(0, "cpu") == 512 and serving.prefill_chunk_for(0, "cuda:0") == 8192
    assert serving.prefill_chunk_for(64, "cuda") == 64
    with pytest.raises(serving.ServeError, match="prefill_chunk"):
        serving.prefill_chunk_for(-1, "cpu")
    assert SETTINGS.get("QWEN38_PREFILL_CHUNK", {"TANDEM_QWEN38_PREFILL_CHUNK": "64"}) == 64
    assert SETTINGS.decl("QWEN38_PREFILL_CHUNK").arithmetic


def test_the_plugin_registers_qwens_tool_format(registered):
    """``qwen_xml`` is this plugin's, found by the server through the registry: the XML body and the JSON one."""
    from tandem_core.plugins import registries
    from tandem_core.server.parse import parse_complete
    from tandem_core.server.toolformat import tool_format
    from tandem_qwen38.toolformat import QwenXml

    assert registries().tool_formats["qwen_xml"] == "tandem_qwen38.toolformat:QwenXml"
    assert isinstance(tool_format("qwen_xml"), QwenXml)
    xml = "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}]
    for text in (xml, '<tool_call>\n{"name": "f", "arguments": {"n": 3}}\n</tool_call>'):
        parsed = parse_complete(text, "qwen_xml", False, False, tools)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"n": 3})]


def test_serve_builds_engine_tokenizer_and_record(qwen38_ckpts):
    ctx = Recorder()
    args = ServeArgs(model_id="tiny-qwen", path=qwen38_ckpts.vl.path, max_context=96,
                     options={"prefill_chunk": 16})
    served = serving.serve(args, ctx)
    assert isinstance(served, Served)
    assert [s for s, _ in ctx.stages] == ["config", "audit", "weights", "engine", "tokenizer"]
    n = len(expected_tensors(served.engine.runner.cfg))
    stored = sum(f.stat().st_size for f in qwen38_ckpts.vl.path.glob("*.safetensors"))
    done, total, what = ctx.progressed[-1]
    assert len(ctx.progressed) == n and done == total and what == "to cpu"      # bytes, to the device
    assert 0.5 * stored < total <= stored                                          # the text model's bytes
    assert [d for d, _, _ in ctx.progressed] == sorted(d for d, _, _ in ctx.progressed)
    assert served.tool_format == "qwen_xml" and served.reasoning and served.think_in_prompt
    im_end = served.tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None and im_end in served.stop_ids
    assert "<think>" in served.chat_template
    info = served.info
    assert info["weights"] == str(qwen38_ckpts.vl.path) and info["dtype"] == "fp32"
    assert info["skipped"]["model.visual."] > 0
    assert info["parameters"] == served.engine.runner.w.parameter_count() > 0
    assert set(info["fingerprints"]) == {"weights", "tokenizer", "manifest"}
    assert {p["name"] for p in info["memory"]} == {"weights", "gdn.S", "gdn.conv", "kv", "pending.sections"}

    eng = served.engine
    assert eng.caps.max_context == 96 and eng.caps.prefill_chunk == 16
    ids = prompt(40, 320)
    with torch.no_grad():
        ref = qwen38_ckpts.vl.model(ids[None]).logits[0]
    got = eng.forward(ids, all_logits=True)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4

    twin = served.spawn()
    assert twin is not eng and twin.runner.w is eng.runner.w
    assert twin.state.sections["gdn.S"].data_ptr() != eng.state.sections["gdn.S"].data_ptr()
    assert twin.kv.length == 0 and torch.equal(twin.forward(ids, all_logits=True), got)


def test_serve_without_tokenizer_names_the_file(qwen38_ckpts, tmp_path):
    path = tmp_path / "no_tok"
    shutil.copytree(qwen38_ckpts.text.path, path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(serving.ServeError, match="no tokenizer.json"):
        serving.serve(ServeArgs(model_id="x", path=path), ServeContext())


def test_serve_caps_max_context_at_the_models_positions(qwen38_ckpts):
    ctx = Recorder()
    served = serving.serve(ServeArgs(model_id="x", path=qwen38_ckpts.text.path, max_context=5000), ctx)
    assert served.engine.caps.max_context == 1024
    assert any("max_position_embeddings 1024" in line for line in ctx.lines)


@pytest.mark.parametrize("template,expected", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}", True),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}", False),
    ("{% for m in messages %}<think>{{ m['content'] }}</think>{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", False),
])
def test_think_in_prompt_reads_the_generation_prompt(template, expected):
    assert serving.think_in_prompt(template) is expected


def test_config_json_is_read_strictly_by_serve(qwen38_ckpts, tmp_path):
    from tandem_core.checkpoint.config import ConfigError

    path = tmp_path / "strict"
    shutil.copytree(qwen38_ckpts.text.path, path)
    raw = json.loads((path / "config.json").read_text())
    raw["hidden_act"] = "relu"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="hidden_act"):
        serving.serve(ServeArgs(model_id="x", path=path), ServeContext())


def test_think_in_prompt_on_the_qwen38_template_fixture():
    from conftest_qwen38 import ROOT

    template = (ROOT / "tests" / "fixtures" / "qwen38_chat_template.jinja").read_text()
    assert serving.think_in_prompt(template) is True
