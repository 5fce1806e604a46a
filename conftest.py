"""Fixtures shared by the whole CPU suite: the core's tests (tests/) and every plugin's (plugins/*/tests/)."""

from __future__ import annotations

import pytest
import torch

import tandem_core.plugins as plugins


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A plugin host with nothing loaded yet (the process's own host is left as it was)."""
    monkeypatch.setattr(plugins, "_host", plugins._Host())
    yield plugins


@pytest.fixture(autouse=True)
def _torch_defaults():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def llama_plugins_one_thread():
    """The llama and drafters plugins registered (as installed distributions would be); one thread: the tiny
    models' tensors are far below ATen's grain, so the count changes no arithmetic, and one thread keeps the many
    small calls fast on a busy runner."""
    from tandem_drafters import plugin as drafters_plugin
    from tandem_llama import plugin as llama_plugin

    from tandem_core.plugins import load_plugins, plugin_manager, register_plugin

    load_plugins()
    pm = plugin_manager()
    for plug, name in ((llama_plugin, "llama"), (drafters_plugin, "drafters")):
        if not pm.is_registered(plug) and pm.get_plugin(name) is None:
            register_plugin(plug, name)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
