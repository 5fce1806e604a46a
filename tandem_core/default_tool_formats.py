"""The core's tool-call format, ``hermes_json``, registered through the same hook as a plugin's.

Registering imports nothing: the format's class is imported when a server first looks it up.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem_core.plugins import hookimpl


@hookimpl
def tandem_tool_formats(register: Callable[[str, str], None]) -> None:
    register("hermes_json", "tandem_core.server.hermes:HermesJson")
