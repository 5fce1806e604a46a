"""The server's ``TANDEM_*`` switches, declared through the same hook as a plugin's (a default plugin)."""

from __future__ import annotations

from tandem_core.plugins import settings_hook
from tandem_core.settings import Setting

__all__ = ["tandem_settings"]

tandem_settings = settings_hook(
    Setting("WAIT_COMMENT_S", 10.0, "tandem_core.server.routes.generation",
            "seconds a streamed request waits for an engine before its stream opens with an SSE comment, "
            "and between two such comments", float),
    Setting("SIDE_LANE", True, "tandem_core.server.state",
            "short requests (<= 2,048 prompt and 64 output tokens, thinking off) that find every engine busy are "
            "served at the running generation's next safe point; off: they queue like any other", bool),
)
