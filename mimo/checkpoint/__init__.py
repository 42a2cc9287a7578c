"""Distributed checkpoints: save, resume (same or another layout), convert, inspect.

See README "Checkpoints and resuming" and docs/checkpoints.md.
"""

from .checks import preflight
from .engine import Checkpointer, checkpointer
from .paths import CheckpointError

__all__ = ["Checkpointer", "CheckpointError", "checkpointer", "preflight"]
