"""Signatures on what a run folder may choose: the job and its arguments, the flags (a logger, an address), a
loop's target. A folder can come from anywhere (a colleague's share, a tarball, a synced folder); what it records
is trusted on a resume only when this user's own key signed it, and otherwise only with --trust-job given now.

The key: 32 random bytes in $MIXTRAIN_HOME/signing_key, made on first use, private (0600), written whole before
it appears under its name (a second mixtrain starting at the same moment reads the first one's key), never read
or written through a symlink. The signature is an HMAC-SHA256 over the record's canonical JSON (sorted keys, no
spaces), kept in the record under "signature"; a folder moved or copied stays signed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any

from mixtrain.errors import InputValueError

KEY_FILE = "signing_key"
KEY_BYTES = 32
FIELD = "signature"
"""The key under which a record holds its signature."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def key_path() -> Path:
    from mixtrain.cluster.state import home

    return home() / KEY_FILE


def _key() -> bytes:
    path = key_path()
    key = _read_key(path)
    if key is None:
        _make_key(path)
        key = _read_key(path)
    assert key is not None  # made just now, or by a mixtrain that won the race
    return key


def _read_key(path: Path) -> bytes | None:
    """The key at `path`, or None when there is none. A symlink, a FIFO, a file of another size, one someone else
    owns or can read: refused (one line naming the fix), never used, since whoever can write it can sign."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _bad_key(path, f"cannot be read ({exc.strerror}); a symlink is refused") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != KEY_BYTES:
            raise _bad_key(path, f"is not a regular file of {KEY_BYTES} bytes")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise _bad_key(path, f"belongs to user id {info.st_uid}, not to you")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise _bad_key(path, f"is readable or writable by others (mode {stat.S_IMODE(info.st_mode):o})")
        return os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)


def _bad_key(path: Path, why: str) -> InputValueError:
    return InputValueError(
        f"{path} (the key that signs your run folders) {why}; remove it (a new one is made on the next run; "
        "folders signed with the old one then need --trust-job once)"
    )


def _make_key(path: Path) -> None:
    """A new key, written and synced under a temporary name, then linked to `path`: the name appears with the
    whole key behind it, and a key someone made there first (or a link planted there) is never overwritten."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{KEY_FILE}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another mixtrain made it first: that key is the key
            os.link(tmp, path, follow_symlinks=False)
    finally:
        os.unlink(tmp)


def _digest(record: dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in record.items() if k != FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with its signature under FIELD (any earlier one replaced)."""
    return {**{k: v for k, v in record.items() if k != FIELD}, FIELD: _digest(record, _key())}


def sign_if_possible(record: dict[str, Any], say: Any) -> dict[str, Any]:
    """`record` signed; when the key cannot be made or read (a read-only home, a full disk) the record unsigned,
    and `say` tells why: the run starts anyway, and its resume will ask for --trust-job."""
    try:
        return sign(record)
    except (OSError, RuntimeError) as exc:  # RuntimeError: ClusterError, MIXTRAIN_HOME not a folder of yours
        say(f"note: command.json is not signed ({exc}); a resume of this run will need --trust-job")
        return record


def signed_by_me(record: dict[str, Any]) -> bool:
    """Whether `record` carries a signature made with this user's key over exactly what it holds now."""
    given = record.get(FIELD)
    if not isinstance(given, str):
        return False
    try:
        key = _key()
    except (OSError, RuntimeError):  # no key can be made here (a read-only home): nothing is signed by us
        return False
    try:
        wanted = _digest(record, key)
    except ValueError:  # a NaN or infinity: never written by mixtrain's own json
        return False
    return hmac.compare_digest(given, wanted)
