"""tandem-lfm25: LiquidAI's LFM2 family (gated short convolutions + grouped-query attention, dense or with a
mixture of experts: ``lfm2_moe`` for LFM2.5-24B-A2B and LFM2-8B-A1B, ``lfm2`` for the dense LFM2 models).

Importing the package imports nothing heavy; the plugin's hooks are in
``tandem_lfm25.plugin``, the model's parts in ``config``, ``weights``, ``moe``,
``model`` and ``serving``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
