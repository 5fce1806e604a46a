"""The conductor: TandemLLM's model name ``TandemLLM``, the weights with a conductor in front (docs/conductor.md)."""
