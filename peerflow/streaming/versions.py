"""Per-sample and per-token-segment weight versions.

A sample generated under one policy version carries that version in
`Batch.weight_version`. With partial rollout, weights change while a sample is being
generated; `GenerationResult.version_segments` then lists `(first_token_index, version)`
for every run of tokens produced by one version. In a `Batch` the same information
travels as the ragged `token_versions` field (one int64 per response token), and
`weight_version` holds the *oldest* segment's version, so staleness is never
under-counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Segments = tuple[tuple[int, int], ...]

#: Ragged int64 field, one weight version per response token.
TOKEN_VERSIONS = "token_versions"


def check_segments(segments: Sequence[tuple[int, int]], num_tokens: int) -> Segments:
    """Validates segments and returns them as a tuple.

    Raises:
        ValueError: the first segment does not start at token 0, starts do not increase,
            a start lies past the sample's end, or versions decrease.
    """
    segments = tuple((int(a), int(v)) for a, v in segments)
    if not segments:
        return segments
    starts = [a for a, _ in segments]
    versions = [v for _, v in segments]
    problem = None
    if starts[0] != 0:
        problem = "the first segment must start at token 0"
    elif any(b <= a for a, b in zip(starts, starts[1:])):
        problem = "segment starts must strictly increase"
    elif starts[-1] > max(num_tokens - 1, 0):
        problem = f"a segment starts past the last of {num_tokens} tokens"
    elif any(w < v for v, w in zip(versions, versions[1:])):
        problem = "weight versions must not decrease along a sample"
    if problem:
        raise ValueError(
            f"version_segments {segments} are invalid: {problem}. Engines with partial "
            "rollout must report (first_token_index, version) per run of tokens."
        )
    return segments


def append_segment(segments: Segments, start: int, version: int) -> Segments:
    """Returns `segments` extended by tokens from `start` on generated under `version`.

    A continuation under the version already in force adds no segment.
    """
    if segments and segments[-1][1] == version:
        return segments
    if segments and start <= segments[-1][0]:
        raise ValueError(
            f"new segment at token {start} does not follow the last segment {segments[-1]}."
        )
    return (*segments, (int(start), int(version)))


def token_versions(
    segments: Sequence[tuple[int, int]], num_tokens: int, default: int
) -> torch.Tensor:
    """Expands segments to one version per token (`[num_tokens]`, int64).

    Args:
        segments: `(first_token_index, version)` runs; empty means all `default`.
        num_tokens: Tokens in the sample.
        default: Version used when `segments` is empty.
    """
    segments = check_segments(segments, num_tokens)
    out = torch.full((num_tokens,), int(default), dtype=torch.int64)
    for start, version in segments:
        out[start:] = version
    return out


def oldest_version(segments: Sequence[tuple[int, int]], default: int) -> int:
    """The version of a sample's oldest tokens (what staleness is measured against)."""
    return min((int(v) for _, v in segments), default=int(default))


def segments_from_token_versions(versions: torch.Tensor) -> Segments:
    """Inverse of `token_versions`: run-length encodes a `[num_tokens]` version tensor."""
    if versions.numel() == 0:
        return ()
    values = versions.tolist()
    return tuple((i, v) for i, v in enumerate(values) if i == 0 or values[i - 1] != v)
