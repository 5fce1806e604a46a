"""The shipped model registry (``tandem_core/shipped/models``), registered through the same hook as a plugin's."""

from __future__ import annotations

from typing import Callable

from tandem_core.catalog import SHIPPED
from tandem_core.plugins import hookimpl


@hookimpl
def tandem_model_entries(register: Callable[[str], None]) -> None:
    if (SHIPPED / "models").is_dir():
        register(str(SHIPPED))
