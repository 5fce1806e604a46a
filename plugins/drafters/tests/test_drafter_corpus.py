"""The lookup corpus store: round trip, refusal under another tokenizer, corruption detected, and the two ways
to build one (`tandem corpus build`, tools/build_corpus.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tandem_core.drafter import DrafterMismatch, TargetInfo, check_target
from tandem_core.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT / "plugins" / "drafters") not in sys.path:
    sys.path.insert(0, str(ROOT / "plugins" / "drafters"))

from tandem_drafters.corpus import SEP, CorpusError, CorpusStore, TokenizerMismatch, build_store  # noqa: E402
from tandem_drafters.lookup import LookupDrafter  # noqa: E402
from tandem_drafters.ngram import DEFAULT_ORDERS, suffix_keys  # noqa: E402

WORDS = ("def return self import from class for in if else while yield with as try except raise "
         "lambda None True False print len range open read write path name value key item list dict").split()


def make_tokenizer(path: Path, words=WORDS) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


PHRASE = [7, 3, 19, 22, 4, 4, 11, 28, 0, 15, 2, 9, 26, 13, 5, 21, 17, 1, 24, 8, 12, 29, 6, 18, 10]


def random_docs(rng: random.Random, n: int, vocab: int = 30) -> list[list[int]]:
    phrase = PHRASE
    docs = []
    for _ in range(n):
        d = [rng.randrange(vocab) for _ in range(rng.randrange(0, 200))]
        at = rng.randrange(len(d) + 1)
        docs.append(d[:at] + phrase + d[at:])  # every document quotes the phrase
    return docs


def brute_occurrences(docs, tail, limit):
    toks = [t for d in docs for t in (*d, SEP)]
    out, seen = [], set()
    for k in sorted(DEFAULT_ORDERS, reverse=True):
        if k > len(tail):
            continue
        for e in range(len(toks) - 1, k - 1, -1):
            w = toks[e - k:e]
            if toks[e] != SEP and SEP not in w and w == tail[-k:] and e not in seen:
                seen.add(e)
                out.append((e, k))
                if len(out) == limit:
                    return out
    return out


@pytest.fixture
def store(tmp_path):
    docs = random_docs(random.Random(0), 40)
    path = build_store(docs, tmp_path / "c.tlk", "a" * 64, meta={"test": True})
    return path, docs


def test_round_trip_answers_as_a_brute_force_search(store):
    path, docs = store
    s = CorpusStore.open(path, "a" * 64)
    assert s.n_docs == 40 and s.n_tokens == sum(len(d) + 1 for d in docs)
    assert s.tokenizer_sha256 == "a" * 64 and s.header["meta"] == {"test": True}
    rng = random.Random(1)
    for _ in range(40):
        d = docs[rng.randrange(len(docs))]
        if len(d) < 3:
            continue
        tail = d[:rng.randrange(1, len(d))][-16:]
        got = s.occurrences(tail, suffix_keys(tail, s.orders), 8)
        assert got == brute_occurrences(docs, tail, 8)
        for e, _ in got:
            c = s.continuation(e, 30)
            assert SEP not in c and len(c) >= 1


def test_the_drafter_proposes_from_the_corpus(store):
    path, _ = store
    d = LookupDrafter(TargetInfo(tokenizer="a" * 64), corpus=path)
    assert d.requires().tokenizer == "a" * 64
    # a prompt never seen in this session, ending inside the phrase every document quotes
    prompt = [31, 32] + PHRASE[:12]
    d.begin(prompt)
    p = d.propose(prompt, 16)
    assert list(p.tokens[:10]) == PHRASE[12:22]


def test_another_tokenizer_is_refused_naming_both_fingerprints(store):
    path, _ = store
    with pytest.raises(TokenizerMismatch) as e:
        CorpusStore.open(path, "b" * 64)
    assert "a" * 64 in str(e.value) and "b" * 64 in str(e.value) and str(path) in str(e.value)
    with pytest.raises(TokenizerMismatch):
        LookupDrafter(TargetInfo(tokenizer="b" * 64), corpus=path)
    # opened without a target, it declares the store's tokenizer, and the load check refuses by name
    d = LookupDrafter(None, corpus=path)
    refusal = r"drafter 'lookup'.*tokenizer sha256 a{64}.*the target's is b{64}"
    with pytest.raises(DrafterMismatch, match=refusal):
        check_target("lookup", d.requires(), TargetInfo(tokenizer="b" * 64))


def test_the_setting_names_the_store(store, monkeypatch):
    path, _ = store
    monkeypatch.setenv("TANDEM_LOOKUP_CORPUS", str(path))
    assert LookupDrafter(TargetInfo(tokenizer="a" * 64)).corpus is not None
    monkeypatch.setenv("TANDEM_LOOKUP_CORPUS", "")
    assert LookupDrafter(TargetInfo(tokenizer="a" * 64)).corpus is None


def test_corruption_is_detected(store, tmp_path):
    path, _ = store
    raw = path.read_bytes()
    flipped = bytearray(raw)
    flipped[-100] ^= 0x40
    bad = tmp_path / "flipped.tlk"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CorpusError, match="corrupt: payload sha256"):
        CorpusStore.open(bad, "a" * 64)
    CorpusStore.open(bad, "a" * 64, verify=False)  # the check can be skipped
    short = tmp_path / "short.tlk"
    short.write_bytes(raw[:-64])
    with pytest.raises(CorpusError, match="truncated"):
        CorpusStore.open(short)
    alien = tmp_path / "alien.tlk"
    alien.write_bytes(b"PK\x03\x04" + raw[4:])
    with pytest.raises(CorpusError, match="not a lookup corpus store"):
        CorpusStore.open(alien)
    garbled = bytearray(raw)
    garbled[16:24] = b"\xff" * 8
    (tmp_path / "garbled.tlk").write_bytes(bytes(garbled))
    with pytest.raises(CorpusError, match="corrupt header"):
        CorpusStore.open(tmp_path / "garbled.tlk")
    with pytest.raises(CorpusError, match="cannot read"):
        CorpusStore.open(tmp_path / "missing.tlk")


def write_sources(d: Path) -> Path:
    src = d / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("def read path return open path read\n" * 5)
    (src / "pkg" / "b.py").write_text("class item for key in dict yield key value\n" * 3)
    (src / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    return src


def test_tandem_corpus_build_and_info(fresh_plugins, monkeypatch, tmp_path, capsys):
    from tandem_core.cli.main import main

    monkeypatch.setenv("TANDEM_DISABLE_ENTRYPOINTS", "1")
    monkeypatch.setenv("TANDEM_EXTRA_PLUGINS", "tandem_drafters.plugin")
    tokjson = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    src = write_sources(tmp_path)
    out = tmp_path / "code.tlk"
    assert main(["corpus", "build", "--tokenizer", str(tokjson), "-o", str(out), str(src)]) == 0
    line = capsys.readouterr().out
    assert "2 files (1 skipped)" in line and "def" not in line  # counts, never text
    fp = HFTokenizer.from_file(tokjson).fingerprint()
    s = CorpusStore.open(out, fp)
    assert s.n_docs == 2
    assert main(["corpus", "info", str(out)]) == 0
    head = json.loads(capsys.readouterr().out)
    assert head["tokenizer_sha256"] == fp and head["n_docs"] == 2
    # --model: a checkpoint folder's tokenizer
    ckpt = tmp_path / "ckpt"
    make_tokenizer(ckpt / "tokenizer.json")
    (ckpt / "config.json").write_text("{}")
    out2 = tmp_path / "code2.tlk"
    assert main(["corpus", "build", "--model", str(ckpt), "-o", str(out2), str(src / "a.py")]) == 0
    assert CorpusStore.open(out2, fp).n_docs == 1
    missing = str(tmp_path / "none")
    assert main(["corpus", "build", "--tokenizer", str(tokjson), "-o", str(out2), missing]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    out2.write_bytes(b"junk")
    assert main(["corpus", "info", str(out2)]) == 2


def test_tools_build_corpus_script(tmp_path):
    tok_a = make_tokenizer(tmp_path / "a" / "tokenizer.json")
    tok_b = make_tokenizer(tmp_path / "b" / "tokenizer.json", WORDS[::-1])
    src = write_sources(tmp_path)
    out = tmp_path / "s.tlk"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_corpus.py"), "--tokenizer", str(tok_a),
                        "-o", str(out), str(src)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fa, fb = HFTokenizer.from_file(tok_a).fingerprint(), HFTokenizer.from_file(tok_b).fingerprint()
    assert fa != fb
    assert CorpusStore.open(out, fa).n_tokens > 0
    with pytest.raises(TokenizerMismatch, match=f"{fa}.*{fb}"):
        CorpusStore.open(out, fb)
