"""tandem-drafters: drafters for TandemLLM's speculative decoding. Importing it does nothing.

``tandem_drafters.plugin`` registers them (entry point ``drafters`` in the group ``tandem``);
``tandem_drafters.lookup`` is the lookup drafter, ``tandem_drafters.corpus`` its persistent store;
``tandem_drafters.mtp`` the MTP drafter over an engine's own multi-token-prediction head.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
