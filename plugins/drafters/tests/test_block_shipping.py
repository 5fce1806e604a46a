"""A block drafter shipped in a model's registry entry: ``tandem pull`` copies and verifies it (size and sha256),
the load-time audit refuses a changed file, the registry check names a file whose size is wrong, ``--spec auto``
takes the shipped drafter in, and the drafter finds its checkpoint from the target's model id."""

from __future__ import annotations

import copy
import hashlib
import shutil
from pathlib import Path

import pytest
import yaml
from block_fixtures import random_block
from tandem_drafters.block import find_checkpoint, read_config
from test_pull import _entry, fake_pip  # noqa: F401  (fixture)

from tandem_core import catalog
from tandem_core.drafter import TargetInfo
from tandem_core.pull import drafter_path
from tandem_core.server.speculation import parse_spec, resolve_drafters


def ship(tmp_path: Path) -> tuple[Path, dict]:
    reg = tmp_path / "reg" / "models" / "tiny-x"
    folder = random_block(reg / "drafters" / "block")
    files = {f: {"bytes": (folder / f).stat().st_size, "sha256": hashlib.sha256((folder / f).read_bytes()).hexdigest()}
             for f in ("config.json", "model.safetensors")}
    base = _entry()
    entry = copy.deepcopy(catalog.entry("smollm2-135m").data) | {
        "id": "tiny-x", "default": False, "source": base["source"], "weights": base["weights"],
        "drafters": {"block": {"source": {"kind": "registry", "path": "drafters/block"}, "files": files}}}
    (reg / "model.yaml").write_text(yaml.safe_dump(entry))
    return reg, entry


def test_pull_verifies_the_shipped_drafter_and_the_audit_refuses_a_changed_file(
        tmp_path, fake_pip, monkeypatch, capsys):  # noqa: F811
    from tandem_core.cli.main import main

    reg, entry = ship(tmp_path)
    monkeypatch.setenv("TANDEM_REGISTRY", str(tmp_path / "reg"))
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    assert resolve_drafters(parse_spec("auto"), "tiny-x") == ("lookup",)      # not pulled yet
    assert main(["pull", "tiny-x", "--quiet"]) == 0
    pulled = tmp_path / "home" / "models" / "tiny-x" / "drafters" / "block"
    assert f"drafter block: {pulled}" in capsys.readouterr().out
    assert drafter_path(entry, "block") == pulled
    assert read_config(pulled).mask_token_id == 319
    assert resolve_drafters(parse_spec("auto"), "tiny-x") == ("lookup", "block")
    assert resolve_drafters(parse_spec("lookup,block,lookup"), "tiny-x") == ("lookup", "block")
    assert parse_spec("off") == ()
    assert find_checkpoint(TargetInfo(name="tiny-x")) == pulled
    # the audit: a changed file (same size) is not served, and pull fetches it again
    w = pulled / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    assert drafter_path(entry, "block") is None and find_checkpoint(TargetInfo(name="tiny-x")) is None
    assert main(["pull", "tiny-x", "--quiet"]) == 0
    assert drafter_path(entry, "block") == pulled
    # a registry file that does not match the entry's sum is refused, naming the file
    shutil.rmtree(pulled)
    src = reg / "drafters" / "block" / "config.json"
    src.write_text(src.read_text().replace('"block_size": 8', '"block_size": 9'))
    assert main(["pull", "tiny-x", "--quiet"]) == 2
    assert "drafter 'block' file config.json has sha256" in capsys.readouterr().err


def test_the_registry_check_names_a_shipped_file_of_the_wrong_size(tmp_path):
    reg, entry = ship(tmp_path)
    entry["drafters"]["block"]["files"]["model.safetensors"]["bytes"] += 1
    (reg / "model.yaml").write_text(yaml.safe_dump(entry))
    e = catalog.Entry("tiny-x", reg / "model.yaml", entry)
    problems = [p for p in catalog.check_entry(e) if "drafter" in p]
    assert problems and "model.safetensors" in problems[0] and "bytes" in problems[0]


@pytest.mark.parametrize("bad", [{"source": {"kind": "ftp"}}, {"files": {}}])
def test_the_schema_refuses_a_malformed_drafter(tmp_path, bad):
    reg, entry = ship(tmp_path)
    entry["drafters"]["block"] |= bad
    problems = catalog.check_entry(catalog.Entry("tiny-x", reg / "model.yaml", entry))
    assert any("drafters/block" in p for p in problems), problems


def test_the_shipped_registry_stays_sound():
    assert catalog.check() == []
