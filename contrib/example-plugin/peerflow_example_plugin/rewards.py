"""`edit-similarity`: partial credit from the Levenshtein distance to the reference."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from peerflow.algorithms import Example, RewardFunction


def levenshtein(a: str, b: str) -> int:
    """Returns the edit distance (insertions, deletions, substitutions) between a and b."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


@attrs.frozen(kw_only=True)
class EditSimilarityOptions:
    """Options of the `edit-similarity` reward."""

    strip: bool = True
    """Strip surrounding whitespace from both strings before comparing."""
    case_sensitive: bool = True
    """Compare case-sensitively."""


class EditSimilarityReward(RewardFunction):
    """Scores `1 - distance / max(len(response), len(answer))`, in [0, 1]."""

    name = "edit-similarity"
    options_class = EditSimilarityOptions

    def _normalise(self, text: str) -> str:
        text = text.strip() if self.options.strip else text
        return text if self.options.case_sensitive else text.lower()

    def score(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        """Returns one similarity per response against `example.answer` (a string)."""
        scores = []
        for response, example in zip(responses, examples, strict=True):
            if not isinstance(example.answer, str):
                raise TypeError(
                    f"edit-similarity needs string answers; example {example.index} has "
                    f"{type(example.answer).__name__}. Pick a reward that fits the task."
                )
            got, want = self._normalise(response), self._normalise(example.answer)
            longest = max(len(got), len(want))
            scores.append(1.0 if longest == 0 else 1.0 - levenshtein(got, want) / longest)
        return scores
