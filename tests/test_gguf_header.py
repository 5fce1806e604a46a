"""The loader's header-only GGUF read agrees with the gguf package's full reader, and names bad files."""

from __future__ import annotations

import numpy as np
import pytest

from tandem_core.checkpoint.gguf import GGUFHeaderError, architecture_of, read_metadata
from tandem_core.loader import LoadError, raw_config


def write(path, arch="llama"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_token_list([f"t{i}" for i in range(300)])          # a string array before the keys asked for
    w.add_token_scores([float(i) for i in range(300)])
    w.add_string("general.name", "tiny")
    w.add_uint32("tandem.after_arrays", 7)
    w.add_tensor("w", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_read_matches_the_full_reader(tmp_path):
    import gguf

    p = write(tmp_path / "m.gguf")
    full = gguf.GGUFReader(str(p))
    keys = ["general.architecture", "general.name", "llama.context_length", "tandem.after_arrays"]
    got = read_metadata(p, keys)
    for k in keys:
        f = full.get_field(k)
        want = f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()[0]
        assert got[k] == want, k
    assert architecture_of(p) == "llama"
    assert raw_config(p) == {"model_type": "llama", "format": "gguf", "gguf_path": str(p)}


def test_bad_files_are_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 20)
    with pytest.raises(GGUFHeaderError, match="bad magic"):
        architecture_of(bad)
    p = write(tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(p.read_bytes()[:40])
    with pytest.raises(LoadError, match="cut.gguf.*truncated"):
        raw_config(cut)
