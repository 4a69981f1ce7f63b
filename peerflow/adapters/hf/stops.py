"""Stop-string detection on token streams, with vLLM's semantics.

A sample ends at the first occurrence of any stop string in its decoded text. The check
runs after every sampled token on a window of the newest tokens only, so its cost does
not grow with the answer length. When a sample stopped on a string, its tokens are cut
back to the longest prefix whose text ends before the stop string (the stop string is
removed from the output, vLLM's default), unless the caller keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: A token decodes to at least one character except for partial UTF-8 bytes (byte-level
#: BPE splits a character into at most 4 tokens); the window covers the longest stop
#: string under that worst case.
_TOKENS_PER_CHAR = 4


class StopStringMatcher:
    """Finds stop strings in sampled token sequences.

    Args:
        tokenizer: Anything with `decode(ids, skip_special_tokens=...)` (a HF tokenizer).
        stops: The stop strings (non-empty).
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError(
                f"SamplingParams.stop={tuple(stops)!r} contains an empty string; every stop "
                "string must have at least one character."
            )
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.window = _TOKENS_PER_CHAR * max(len(s) for s in self.stops) + 2

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def hit(self, ids: Sequence[int]) -> bool:
        """Whether the newest tokens of `ids` complete a stop string."""
        text = self._decode(ids[-self.window :])
        return any(s in text for s in self.stops)

    def cut(self, ids: Sequence[int], keep_stop: bool = False) -> int:
        """Returns how many leading tokens of a stopped sample to keep.

        Args:
            ids: Every token of the sample, the last one completing a stop string.
            keep_stop: Keep the tokens that spell the stop string.

        Returns:
            `len(ids)` when keeping the stop string or when no stop string is found;
            otherwise the largest `k` such that `decode(ids[:k])` ends before the first
            stop string starts.
        """
        if keep_stop:
            return len(ids)
        text = self._decode(ids)
        starts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if not starts:
            return len(ids)
        start = min(starts)
        for k in range(len(ids) - 1, -1, -1):
            if len(self._decode(ids[:k])) <= start:
                return k
        return 0
