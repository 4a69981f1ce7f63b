"""Rounding a size up to a multiple: padded vocabularies and aligned buffer offsets.

The one implementation used by the layout builders (`peerflow.models`), the packed
batches and shared-memory segments of the coordinator, the weight-sync arenas and the
vLLM weight channel.
"""

from __future__ import annotations


def pad_to_multiple(value: int, multiple: int) -> int:
    """Returns `value` rounded up to a multiple of `multiple` (a positive integer)."""
    return -(-value // multiple) * multiple
