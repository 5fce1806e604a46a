"""The op registry: a plugin defines an op of its own with its reference, and a device's kernel registers beside
it; redefining an op with another reference is refused naming both."""

from __future__ import annotations

import pytest
import torch

from tandem_core import ops


def test_a_plugin_op_gets_its_reference_and_a_device_kernel():
    ops.define("test_double", "operator:add")          # any importable function stands for a reference
    try:
        assert ops.get("test_double", "cpu")(2, 2) == 4
        assert "test_double" in ops.names()
        ops.define("test_double", "operator:add")      # the same definition again: nothing changes
        with pytest.raises(ValueError, match="already defined by operator:add"):
            ops.define("test_double", "operator:mul")
        ops.register("test_double", "cuda", lambda a, b: ("kernel", a, b))
        assert ops.get("test_double", torch.device("cuda", 0))(1, 2) == ("kernel", 1, 2)
        assert ops.get("test_double", "cpu")(1, 2) == 3
    finally:
        ops.unregister("test_double", "cuda")
        ops.REFERENCES.pop("test_double", None)


def test_an_unknown_op_is_named():
    with pytest.raises(KeyError, match="unknown op 'no_such_op'"):
        ops.get("no_such_op")
    with pytest.raises(KeyError, match="unknown op 'no_such_op'"):
        ops.register("no_such_op", "cuda", lambda: None)
