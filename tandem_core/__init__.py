"""TandemLLM core. Importing it does nothing: plugins load on ``tandem_core.plugins.load_plugins()``."""

__version__ = "0.1.0"
__all__ = ["__version__"]
