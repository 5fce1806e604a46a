"""tandem-qwen38: the dense Gated DeltaNet + gated attention hybrid (Qwen3.5 architecture, Qwen3.8 27B).

Importing the package imports nothing heavy; the plugin's hooks are in
``tandem_qwen38.plugin``, the model's parts in ``config``, ``weights``,
``model`` and ``serving``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
