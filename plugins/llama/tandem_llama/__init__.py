"""tandem-llama: the Llama family (LlamaForCausalLM; GGUF general.architecture = llama) for TandemLLM.

Importing this package does nothing; the plugin is ``tandem_llama.plugin`` (entry point ``llama``).
"""

__all__: list[str] = []
