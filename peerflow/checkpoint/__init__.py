"""Checkpoints: one layout for every trainable role in both modes, verified on resume.

* `save_step`, `restore_latest` — the API the run driver calls (`api`).
* `atomic_path`, `write_text_atomic`, `write_json_atomic` — the one atomic-write helper.
* `list_checkpoints`, `newest_complete`, `newest_verified`, `prune`, `step_dir` — the
  run's checkpoints.
* `write_manifest`, `verify` — sizes and SHA-256 of every file, written last.
* `check_shapes` — strict loads: every saved tensor's shape matches exactly.
"""

from peerflow.checkpoint.api import (
    TRAINABLE_ROLES,
    Resumed,
    restore_latest,
    save_step,
    should_checkpoint,
    trainable_engines,
)
from peerflow.checkpoint.atomic import atomic_path, write_json_atomic, write_text_atomic
from peerflow.checkpoint.manifest import verify, write_manifest
from peerflow.checkpoint.state import truncate_metrics
from peerflow.checkpoint.store import (
    CheckpointInfo,
    list_checkpoints,
    newest_complete,
    newest_verified,
    prune,
    step_dir,
)
from peerflow.checkpoint.strict import check_same_layout, check_shapes, read_engine_meta

__all__ = [
    "TRAINABLE_ROLES",
    "CheckpointInfo",
    "Resumed",
    "atomic_path",
    "check_same_layout",
    "check_shapes",
    "list_checkpoints",
    "newest_complete",
    "newest_verified",
    "prune",
    "read_engine_meta",
    "restore_latest",
    "save_step",
    "should_checkpoint",
    "step_dir",
    "trainable_engines",
    "truncate_metrics",
    "verify",
    "write_json_atomic",
    "write_manifest",
    "write_text_atomic",
]
