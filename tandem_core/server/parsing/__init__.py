"""Streaming parsers for what a model writes: reasoning, content and tool calls, one concern a module.

- ``events``: the typed events (``Content``, ``Reasoning``, ``ToolCallBegin``/``Args``/``End``,
  ``Malformed``) and how neighbours merge
- ``text``: the buffer fed in pieces, held tag prefixes, the format's whitespace; ``NoCalls``
- ``reasoning``: the reasoning block at the output's start (``ReasoningSplitter``)
- ``tagged``: calls in a ``<tool_call>`` block, each body in one of a format's forms; the JSON body
- ``jsonscan``: the incremental scanner of a JSON call body
- ``values``: a parameter's text typed by its schema; the tools' schemas by function
- ``collect``: events folded into a whole answer (``Collected``, ``ToolCall``)
- ``output``: ``OutputParser`` (reasoning, then the model's registered format), ``parse_complete``

``tandem_core.server.parse`` is the public face: the names a server, a plugin or a test imports.
"""
