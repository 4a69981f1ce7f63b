"""Control records a run acts on carry an HMAC under the run's secret; others are refused.

`TCPStore` has no authentication: whoever reaches a store's port can write any key. The
records PeerFlow reads and acts on (the abort record, stop requests, each rank's host and
pid, the torchrun generation's store address) are therefore written through
`SignedStore`, which appends `HMAC-SHA256(secret, scope, key, value)` to every value, and
read back through it, which refuses (logs once, ignores) a value without a valid tag. A
writer without the secret can still delete, overwrite or flood keys (deny service), but
it cannot make a run act on a record it made up.

The secret (`run_secret`): `PEERFLOW_RUN_SECRET`, or the file `PEERFLOW_RUN_SECRET_FILE`
names (owner-only, mode 0600). `peerflow train` on one host generates one and hands it to
its workers in the environment; a multi-host run needs the operator to give every host
the same one (`require_run_secret`). Without a secret (a job on one host started by hand,
a test) records are written and read unsigned, as before.

Counters (`add`, the heartbeats) are not signed: a forged increment can only make a dead
rank look alive until the launcher's process watch or a collective's timeout notices it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from peerflow.distributed.ranklog import append_to_rank_log
from peerflow.errors import ConfigError, WorkerFailedError

#: Environment variable holding the run's secret.
RUN_SECRET_ENV = "PEERFLOW_RUN_SECRET"
#: Environment variable naming a 0600 file holding the run's secret.
RUN_SECRET_FILE_ENV = "PEERFLOW_RUN_SECRET_FILE"
#: Shortest secret accepted (characters).
MIN_SECRET_CHARS = 16
#: Distinct refused values logged per key (a writer changing its value at every poll
#: would otherwise grow the rank's log and memory without bound).
MAX_LOGGED = 16
_TAG = b"pf1:"
_MAC_CHARS = 64
_HOW = ("generate one with `python -c 'import secrets; print(secrets.token_hex(32))'` and "
        f"give every host the same value in {RUN_SECRET_ENV}, or in a file only its owner "
        f"can read (chmod 600) named by {RUN_SECRET_FILE_ENV}")


class RecordRefusedError(WorkerFailedError):
    """A store record PeerFlow needs is not signed with the run's secret, or is invalid."""


def _checked(secret: str, where: str) -> bytes:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"{where}: the run secret has {len(secret)} characters, fewer than "
                          f"{MIN_SECRET_CHARS}; {_HOW}.")
    return secret.encode()


def run_secret() -> bytes | None:
    """The run's secret from the environment or its file, or `None` when none is set.

    Raises:
        ConfigError: the secret is too short, or its file is missing or readable by others.
    """
    value = os.environ.get(RUN_SECRET_ENV)
    if value:
        return _checked(value, RUN_SECRET_ENV)
    path = os.environ.get(RUN_SECRET_FILE_ENV)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(f"{RUN_SECRET_FILE_ENV}={path}: cannot open it ({exc}); {_HOW}."
                          ) from exc
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        mode = info.st_mode
        if info.st_uid != os.geteuid():
            raise ConfigError(f"{RUN_SECRET_FILE_ENV}={path}: the file is owned by uid "
                              f"{info.st_uid}, not this account (uid {os.geteuid()}): that "
                              f"account knows the secret; {_HOW}.")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{RUN_SECRET_FILE_ENV}={path}: mode {stat.filemode(mode)} lets "
                              f"other accounts read the run secret; run `chmod 600 {path}`.")
        return _checked(f.read(), f"{RUN_SECRET_FILE_ENV}={path}")


def require_run_secret(why: str) -> bytes:
    """The run's secret; raises naming the fix when none is set.

    Raises:
        ConfigError: no secret is set (or it is invalid).
    """
    secret = run_secret()
    if secret is None:
        raise ConfigError(f"{why}: its stores are reachable from other machines, so the run "
                          f"needs a secret to tell its own records from strangers'; {_HOW}.")
    return secret


def new_run_secret() -> str:
    """A fresh secret (what the launcher of a run on one host generates)."""
    return secrets.token_hex(32)


@attrs.define(eq=False)
class SignedStore:
    """A store whose values are tagged on write and verified on read (module docstring).

    Without a secret it passes values through unchanged.
    """

    raw: Any
    """The underlying `torch.distributed.Store`."""
    secret: bytes | None
    """The run's secret (`None`: unsigned)."""
    scope: str = ""
    """Binds tags to one use of the store (a torchrun generation's nonce)."""
    _refused: set[tuple[str, bytes]] = attrs.field(factory=set)
    """(key, SHA-256 of the value) of the refusals logged, at most `MAX_LOGGED` per key."""

    def _mac(self, key: str, value: bytes) -> bytes:
        message = b"\0".join((self.scope.encode(), key.encode(), value))
        return hmac.new(self.secret or b"", message, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        """`value` as stored under `key`: tagged when the store has a secret."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        return data if self.secret is None else _TAG + self._mac(key, data) + b":" + data

    def unseal(self, key: str, stored: bytes) -> bytes | None:
        """The value `stored` under `key` carries, or `None` (logged) when its tag is wrong."""
        if self.secret is None:
            return stored
        head, mac, data = stored[:len(_TAG)], stored[len(_TAG):len(_TAG) + _MAC_CHARS], \
            stored[len(_TAG) + _MAC_CHARS + 1:]
        if head == _TAG and hmac.compare_digest(mac, self._mac(key, data)):
            return data
        self._refuse(key, stored)
        return None

    def _refuse(self, key: str, stored: bytes) -> None:
        seen = (key, hashlib.sha256(stored).digest())
        logged = sum(1 for k, _ in self._refused if k == key)
        if seen in self._refused or logged > MAX_LOGGED:
            return
        self._refused.add(seen)
        text = (f"peerflow: refused the record under {key!r} in the run's store: it is not "
                f"signed with the run's secret (a process outside the run wrote it); "
                f"ignored. It read {stored[:160]!r}.")
        if logged == MAX_LOGGED:
            self._refused.add((key, b""))  # the marker: nothing more is logged for the key
            text = (f"peerflow: {MAX_LOGGED} refused records under {key!r} logged; further "
                    "refusals under it are ignored without a line (a process outside the "
                    "run keeps writing it).")
        print(text, file=sys.stderr, flush=True)
        append_to_rank_log(text)

    def set(self, key: str, value: str | bytes) -> None:
        """Stores a tagged `value`."""
        self.raw.set(key, self.seal(key, value))

    def get(self, key: str) -> bytes:
        """The value under `key` (waits for it like the store does).

        Raises:
            RecordRefusedError: the stored value's tag is wrong.
        """
        value = self.unseal(key, self.raw.get(key))
        if value is None:
            raise RecordRefusedError(f"the record under {key!r} in the run's store is not "
                                     "signed with the run's secret; another process wrote it")
        return value

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """`get` of several keys at once."""
        values = [self.unseal(k, v) for k, v in zip(keys, self.raw.multi_get(list(keys)))]
        bad = [k for k, v in zip(keys, values) if v is None]
        if bad:
            raise RecordRefusedError(f"the records under {bad} in the run's store are not "
                                     "signed with the run's secret; another process wrote them")
        return values  # type: ignore[return-value]

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key holds a value with a valid tag."""
        if not self.raw.check(list(keys)):
            return False
        if self.secret is None:
            return True
        return all(self.unseal(k, self.raw.get(k)) is not None for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Sets `desired` if the key holds `expected` ("": absent); returns the value now.

        A value with a wrong tag under the key counts as absent: it is replaced.
        """
        sealed = self.seal(key, desired)
        want = b"" if expected == "" else self.seal(key, expected)
        current = bytes(self.raw.compare_set(key, want, sealed))
        for _ in range(8):
            value = self.unseal(key, current)
            if value is not None:
                return value
            current = bytes(self.raw.compare_set(key, current, sealed))
        return self.get(key)

    def add(self, key: str, amount: int) -> int:
        """Adds to an (unsigned) counter."""
        return int(self.raw.add(key, amount))

    def wait(self, keys: Sequence[str], *args: Any) -> None:
        """Waits until every key exists (its tag is checked when it is read)."""
        self.raw.wait(list(keys), *args)

    def delete_key(self, key: str) -> bool:
        """Deletes a key."""
        return bool(self.raw.delete_key(key))

    def set_timeout(self, timeout: Any) -> None:
        """Sets the underlying store's timeout."""
        self.raw.set_timeout(timeout)


def signed(store: Any, secret: bytes | None = None, scope: str = "") -> SignedStore:
    """`store` as a `SignedStore` under `secret` (default: `run_secret()`); idempotent."""
    if isinstance(store, SignedStore):
        return store
    return SignedStore(raw=store, secret=run_secret() if secret is None else secret,
                       scope=scope)
