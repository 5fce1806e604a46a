"""tandem-flashnext: Flash-Next (transformers' ``qwen4_exp``), the MoE member of the Qwen3.8 family.

Gated DeltaNet and QSA indexed attention layers, a sparse mixture of small experts
with a shared expert, hyper-connections (several residual streams), per-layer
n-gram embeddings (PLE) and an MTP head. Importing the package imports nothing
heavy; the model's parts are in ``config``, ``weights``, ``ngram``, ``layers``,
``model`` and ``mtp``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
