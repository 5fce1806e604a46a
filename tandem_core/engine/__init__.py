"""The engine layer: the contracts every engine speaks (``base``), the runner contract a model plugin
implements (``runner``), and the one sequence engine over a runner (``sequence``).

    server / caches / spec / self-check
            |  hot and cold verbs, typed Capabilities          (base)
    SequenceEngine: the sequence, written once                 (sequence)
            |  Runner protocol                                 (runner)
    a plugin's runners: the model's arithmetic only
"""

from tandem_core.engine.base import (
    Capabilities, DraftHead, Engine, HeadRows, KVInfo, Manifest, MemoryPart, MTPEngine, ResumableEngine,
    Trace, TreeEngine, TreeOut, op_paths, restore_state, source_files, supports_mtp, supports_resume,
    supports_tree, tensor_bytes, head_append, head_launch,
)
from tandem_core.engine.runner import Capture, LogitRows, Rows, Runner, RunnerSpec, Step, TreeStep
from tandem_core.engine.sequence import ContextFull, SequenceEngine

__all__ = [
    "Capabilities", "Engine", "KVInfo", "Manifest", "MemoryPart", "ResumableEngine", "Trace", "TreeEngine",
    "TreeOut", "DraftHead", "HeadRows", "MTPEngine", "supports_mtp", "head_append", "head_launch",
    "restore_state", "supports_resume", "supports_tree", "source_files", "op_paths", "tensor_bytes",
    "Capture", "LogitRows", "Rows", "Runner", "RunnerSpec", "Step", "TreeStep", "ContextFull", "SequenceEngine",
]
