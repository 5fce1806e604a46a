"""``tandem train-drafter`` on a tiny Llama (CPU, a few steps): data from source files and chat prompts answered by
the target, a held-out split, checkpoints, a resume that continues the step count, and a drafter that loads, fits
the target and keeps speculative decoding lossless; two workers write the same samples one does; the batched data
stage (``--batch 4``) writes the samples the one-prompt path writes, and the train stage's features of its
samples equal the rows that path stores."""

from __future__ import annotations

import json

import pytest
import torch
from block_fixtures import serve_tiny, write_tiny_llama
from tandem_drafters import train as T
from tandem_drafters.block import read_config
from test_llama_tiny import bpe  # noqa: F401  (fixture)

from tandem_core.cli.main import main
from tandem_core.drafter import TargetInfo, build_drafter
from tandem_core.spec.loop import Decode, DecodeRequest
from tandem_core.spec.sampler import SamplingParams
from tandem_core.spec.speculate import SpecDecode, Speculation

SOURCE = '''
def add(a, b):
    """Add two numbers."""
    return a + b


class Box:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value
'''


@pytest.fixture(scope="module", autouse=True)
def _plugins(llama_plugins_one_thread):
    yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bpe):  # noqa: F811
    return write_tiny_llama(tmp_path_factory.mktemp("tinyllama") / "m", bpe)


def args(tiny, out, src, *extra):
    return ["train-drafter", "--model", str(tiny), "-o", str(out), "--device", "cpu", "--samples", "10",
            "--max-new", "10", "--max-prompt", "200", "--sources", str(src), "--target-layer-ids", "0,1",
            "--block-size", "4", "--layers", "1", "--samples-per-step", "2", "--anchors", "4",
            "--eval-every", "3", "--checkpoint-every", "3", "--held-out", "0.2", "--warmup", "2", *extra]


def test_train_resume_and_serve_the_drafter(tmp_path, tiny, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"m{i}.py").write_text(SOURCE.replace("add", f"add{i}"))
    out = tmp_path / "work"
    assert main(args(tiny, out, src, "--steps", "6")) == 0
    assert "drafter:" in capsys.readouterr().out
    samples = T.load_samples(out)
    assert 8 <= len(samples) <= 10 and {s["kind"] for s in samples} >= {"chat", "completion"}
    s = samples[0]
    assert "feats" not in s and s["prompt_len"] < s["tokens"].numel()   # the batched stage (auto: 8 on the CPU)
    log = list(T.iter_log(out / "log.jsonl"))
    evals = [r for r in log if r["stage"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and all(r["held_blocks"] > 0 for r in evals)
    assert any(r["stage"] == "data" and r["samples"] == len(samples) for r in log)
    cfg = read_config(out / "drafter")
    # the drafter kept is the one of the best held-out loss
    best = min(evals, key=lambda r: r["held_loss"])
    assert cfg.extra["trained_steps"] == best["step"] and cfg.extra["held_loss"] == best["held_loss"]
    assert cfg.target_layer_ids == (0, 1) and cfg.tokenizer is not None
    # resume: the data stage has nothing left to do, training continues from step 6
    assert main(args(tiny, out, src, "--steps", "9")) == 0
    log = list(T.iter_log(out / "log.jsonl"))
    start = [r for r in log if r["stage"] == "train-start"]
    assert start[-1]["resumed"] and start[-1]["step"] == 6
    assert [r for r in log if r["stage"] == "data"][-1]["new"] == 0
    assert [r for r in log if r["stage"] == "train-end"][-1]["step"] == 9
    evals = [r for r in log if r["stage"] == "eval"]
    assert read_config(out / "drafter").extra["held_loss"] == min(r["held_loss"] for r in evals)
    # the drafter loads for its target and speculation with it stays lossless
    served = serve_tiny(tiny)
    target = TargetInfo.of_engine(served.engine, tokenizer=served.tokenizer.fingerprint(),
                                  vocab_size=served.tokenizer.vocab_size, name="tiny")
    d = build_drafter("block", target, path=str(out / "drafter"))
    from test_drafter_block import IdDetok, flat_cut

    prompt = [int(t) for t in samples[1]["tokens"][: samples[1]["prompt_len"]]]
    req = DecodeRequest(prompt, 12, SamplingParams(temperature=0.0))
    plain = [t for c in Decode(served.spawn(), req, IdDetok()).run() for t in c.tokens]
    dec = SpecDecode(served.engine, req, IdDetok(), speculation=Speculation([d], flat_cut(), 8))
    assert [t for c in dec.run() for t in c.tokens] == plain
    assert dec.stats.drafted > 0


def test_two_workers_write_what_one_writes(tmp_path, tiny):
    src = tmp_path / "src"
    src.mkdir()
    (src / "m.py").write_text(SOURCE)
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--stage", "data", "--samples", "4", "--batch", "1"]
    assert main([*args(tiny, one, src), *common]) == 0
    assert main([*args(tiny, two, src), *common, "--workers", "2"]) == 0
    a, b = T.load_samples(one), T.load_samples(two)
    assert [s["i"] for s in a] == [s["i"] for s in b]
    for x, y in zip(a, b):
        assert torch.equal(x["tokens"], y["tokens"])
        assert x["feats"].shape == (x["tokens"].numel(), 2 * 64) and torch.equal(x["feats"], y["feats"])


def test_batched_data_equals_one_prompt_at_a_time(tmp_path, tiny):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"m{i}.py").write_text(SOURCE.replace("add", f"add{i}"))
    one, four = tmp_path / "one", tmp_path / "four"
    common = ["--stage", "data", "--samples", "10"]
    assert main([*args(tiny, one, src), *common, "--batch", "1"]) == 0
    # in two calls: the second resumes from the shards the first wrote
    assert main([*args(tiny, four, src), "--stage", "data", "--samples", "6", "--batch", "4"]) == 0
    assert len(T.load_samples(four)) >= 4
    assert main([*args(tiny, four, src), *common, "--batch", "4"]) == 0
    a, b = T.load_samples(one), T.load_samples(four)
    assert len(a) >= 8 and [s["i"] for s in a] == [s["i"] for s in b]
    assert {s["kind"] for s in b} >= {"chat", "completion"}
    for x, y in zip(a, b):
        assert torch.equal(x["tokens"], y["tokens"]) and x["prompt_len"] == y["prompt_len"]
        assert "feats" not in y
    log = [r for r in T.iter_log(four / "log.jsonl") if r["stage"] == "data"]
    assert [r["batch"] for r in log] == [4, 4] and log[-1]["samples"] == len(b)
    # the train stage's features of the batched samples: the rows the one-prompt stage stored (bf16)
    served = serve_tiny(tiny)
    feats = T.Features(served.engine, (0, 1))(b)
    for x, f in zip(a, feats):
        assert f.dtype == torch.bfloat16 and f.shape == x["feats"].shape
        torch.testing.assert_close(f.float(), x["feats"].float(), rtol=2e-2, atol=2e-2)


def test_bad_arguments_are_one_line(tmp_path, tiny, capsys):
    assert main(["train-drafter", "--model", str(tiny), "-o", str(tmp_path / "w"), "--device", "cpu",
                 "--target-layer-ids", "0,7"]) == 2
    err = capsys.readouterr().err
    assert "layers [7]" in err and "Traceback" not in err
    assert main(["train-drafter", "--model", str(tmp_path / "nothing"), "-o", str(tmp_path / "w")]) == 1
    assert main(["train-drafter", "--model", str(tiny), "-o", str(tmp_path / "w"), "--device", "cpu",
                 "--batch", "-2"]) == 2
    err = capsys.readouterr().err
    assert "--batch" in err and "Traceback" not in err


def test_held_out_files_are_never_prompts():
    files = T.source_files(limit=400)
    held = [f for f in files if T.held_out_file(f)]
    assert held and len(held) < len(files) / 4
    assert json.dumps(T.make_request(3, files)) == json.dumps(T.make_request(3, files))


def test_the_benchmark_script_runs_and_every_answer_equals_plain(tmp_path, tiny):
    import importlib.util
    from pathlib import Path

    from block_fixtures import random_block

    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("bench_block_drafter", root / "tools" / "bench_block_drafter.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    block = random_block(tmp_path / "b")
    out = tmp_path / "bench.json"
    md = tmp_path / "m.md"
    assert bench.main(["--model", str(tiny), "--drafter", str(block), "--device", "cpu", "--prompts", "1",
                       "--max-new", "6", "--max-tree", "4", "--snippet-chars", "60", "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    assert res["mismatches"] == 0 and set(res["results"]) == {"code", "agent", "chat"}
    assert set(res["results"]["code"]) >= {"lookup", "block", "lookup,block"}
    assert res["results"]["chat"]["prompts"] == 1 and res["results"]["chat"]["lookup,block"]["accept_len"] >= 1.0
    assert "| code | lookup,block |" in md.read_text()
