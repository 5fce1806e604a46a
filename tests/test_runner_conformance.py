"""The runner conformance suite on two runners no core file knows: the toy families of tests/plugins/.

``toy_model_plugin`` is registered in the test the way any plugin is and served through the one loader
(``load_served``); the suite (``tandem_core.testing.conformance``) then runs unchanged on its engine, the core's
``SequenceEngine`` over its ``ToyRunner``. The tree toy (``toy_tree_runner``) runs it too. Nothing under
``tandem_core/`` names either.
"""

from __future__ import annotations

import pytest

from tandem_core.loader import load_served
from tandem_core.serving import ServeArgs
from tandem_core.testing.conformance import RunnerCase, RunnerContract
from test_load_shared import PLUGINS, write_toy


@pytest.fixture(scope="module")
def toy_served(tmp_path_factory):
    import sys

    import tandem_core.plugins as plugins

    sys.path.insert(0, str(PLUGINS))
    import toy_model_plugin

    before = plugins._host
    plugins._host = plugins._Host()
    plugins.register_plugin(toy_model_plugin, "toy")
    try:
        d = tmp_path_factory.mktemp("toy") / "toy"
        write_toy(d, vocab=64, hidden=8)
        yield load_served(str(d), args=ServeArgs("toy", d, max_context=256))
    finally:
        plugins._host = before


class TestAToyRunnerThroughTheLoader(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, toy_served):
        from toy_model_plugin import toy_engine

        r = toy_served.engine.runner

        def build(max_context: int = 256, max_tree: int = 64):
            return toy_engine(r.embed, r.head, max_context, max_tree)

        assert type(toy_served.engine).__name__ == "SequenceEngine"
        return RunnerCase(build=build, vocab=64)


class TestTheToyTreeRunner(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def case(cls):
        from toy_tree_runner import toy_tree_engine

        return RunnerCase(build=lambda max_context=256, max_tree=64: toy_tree_engine(
            vocab=48, max_context=max_context, max_tree=max_tree), vocab=48)
