"""Checkpoint reading: the strict config reader, the tensor layout, the safetensors reader and the audit."""

from tandem_core.checkpoint.audit import AuditError, Expect, audit
from tandem_core.checkpoint.config import ConfigError, FieldPolicy, read_strict, split_text_config
from tandem_core.checkpoint.layout import Layout
from tandem_core.checkpoint.safetensors import SafetensorsCheckpoint, TensorInfo

__all__ = [
    "AuditError", "Expect", "audit", "ConfigError", "FieldPolicy", "read_strict", "split_text_config",
    "Layout", "SafetensorsCheckpoint", "TensorInfo",
]
