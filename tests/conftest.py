"""Shared fixtures for the CPU suite."""

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
