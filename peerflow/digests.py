"""SHA-256 of files: the one hasher behind manifests, fingerprints and input facts.

`sha256_files` reads files in the order given, in 1 MiB chunks (a model's weights never
sit in memory whole); with `root`, each file's path relative to it comes first, so a
renamed file changes the digest. `sampled_sha256` identifies large weight files from
their names, sizes and three samples each, without reading them whole. `tensor_sha256`
hashes one tensor's bytes (what a rollout engine's `checksums()` reports).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Bytes read at a time, and the size of each sample of `sampled_sha256`.
CHUNK = 1 << 20


def sha256_files(files: Iterable[Path], *, root: Path | None = None) -> tuple[int, str]:
    """Bytes read and the SHA-256 of `files`' contents, in order.

    Args:
        files: The files to hash (the caller picks the order).
        root: When given, each file's path relative to `root` and a NUL byte precede its
            contents in the digest.

    Returns:
        `(total bytes, hex digest)`.
    """
    digest = hashlib.sha256()
    size = 0
    for file in files:
        if root is not None:
            digest.update(str(Path(file).relative_to(root)).encode() + b"\0")
        with open(file, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
    return size, digest.hexdigest()


def sha256_file(path: Path) -> str:
    """The SHA-256 of one file's contents (hex)."""
    return sha256_files([path])[1]


def sampled_sha256(files: Iterable[Path]) -> str:
    """A SHA-256 identifying large files by name, size and three samples each.

    Each file contributes `name:size` and `CHUNK` bytes from its start, middle and end:
    another file of the same size (fine-tuned weights) differs, and a 7B model's 14 GB are
    not read.
    """
    digest = hashlib.sha256()
    for file in files:
        size = Path(file).stat().st_size
        digest.update(f"{Path(file).name}:{size}".encode())
        with open(file, "rb") as handle:
            for offset in sorted({0, max(0, size // 2 - CHUNK // 2), max(0, size - CHUNK)}):
                handle.seek(offset)
                digest.update(handle.read(CHUNK))
    return digest.hexdigest()


def tensor_sha256(tensor: Any) -> str:
    """The SHA-256 of a tensor's bytes (hex), read on the host in its own dtype.

    Args:
        tensor: A `torch.Tensor` on any device (copied to the host, made contiguous).
    """
    import torch

    data = tensor.detach().cpu().contiguous().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()
