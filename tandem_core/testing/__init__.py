"""Test support shipped with the core: what a model plugin's tests import to prove it keeps the contracts.

``conformance.RunnerContract`` is the suite every runner passes unchanged (``docs/adding-a-model.md``);
``trees`` holds the tree-verify helpers it and the decode loop's tests share. Needs pytest; imported only by
tests.
"""
