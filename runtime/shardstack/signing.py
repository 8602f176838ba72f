"""Manifest signatures: HMAC-SHA256 with a per-cluster key kept off the shared storage. Checkpoints
(train.checkpoint) and model exports (model.manifest) are signed with it.

The manifest's sizes and sha256 catch damage; anyone who can write the directory can also rewrite them.
The signature is what they cannot forge without the key: it covers the canonical form of the whole manifest
(sorted-key, compact JSON without the `signature` field), so every file's hash, the step and the job config are
authenticated together. The key is read from a file that only its user (the job's account; the inference service
through systemd's LoadCredential=) can read; its bytes never reach a log, an error message or an artifact
(`SigningKey` does not print them).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError

DEFAULT_KEY_FILE = "/etc/shardstack/checkpoint.key"  # checkpoint.signing_key_file and the CLI's --key-file
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 32
_KEY_ID_MESSAGE = b"shardstack checkpoint signing key id"
_KEY_HINT = "generate one with `openssl rand -hex 32`, owned by the job's account, mode 0400, off the shared storage"


@dataclass(frozen=True)
class SigningKey:
    path: Path
    secret: bytes = field(repr=False)

    @property
    def key_id(self) -> str:
        """Names the key in manifests and messages without revealing it (an HMAC of a fixed message)."""
        return hmac.new(self.secret, _KEY_ID_MESSAGE, hashlib.sha256).hexdigest()[:16]


def load_signing_key(path: str | os.PathLike) -> SigningKey:
    """The key in `path` (surrounding whitespace ignored): at least 32 bytes, accessible to its owner only."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ShardstackError(f"no signing key at {path}", hint=_KEY_HINT) from None
    except OSError as exc:
        raise ShardstackError(f"cannot read the checkpoint signing key {path}: {exc.strerror}",
                              hint="it must be readable by the job's account") from None
    try:  # checked on the open file, so what is checked is what is read
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShardstackError(f"the checkpoint signing key {path} is not a regular file", hint=_KEY_HINT)
        acl = _acl(fd)
        if _others_may_access(st, acl):
            raise ShardstackError(
                f"the checkpoint signing key {path} is accessible to other accounts (mode "
                f"{stat.S_IMODE(st.st_mode):04o}{' and its ACL' if acl else ''})",
                hint=f"chmod 0400 {path}" + (f"; setfacl -b {path}" if acl else ""))
        with os.fdopen(fd, "rb", closefd=False) as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ShardstackError(f"cannot read the checkpoint signing key {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(secret) < MIN_KEY_BYTES:
        raise ShardstackError(
            f"the checkpoint signing key {path} is too short ({len(secret)} bytes; at least {MIN_KEY_BYTES})",
            hint=_KEY_HINT)
    return SigningKey(path, secret)


# POSIX access ACL: the xattr's entries after a 4-byte version, each (tag, perm, id) little-endian.
_ACL_XATTR = "system.posix_acl_access"
_ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = 0x02, 0x04, 0x08, 0x10, 0x20


def _acl(fd: int) -> list[tuple[int, int, int]]:
    try:
        raw = os.getxattr(fd, _ACL_XATTR)
    except OSError:  # no ACL (ENODATA), or a file system without them
        return []
    return [struct.unpack_from("<HHI", raw, off) for off in range(4, len(raw) - 7, 8)]


def _others_may_access(st: os.stat_result, entries: list[tuple[int, int, int]]) -> bool:
    """Whether an account other than the file's owner and this process's may read or write it. With an ACL the mode's
    group bits are the ACL's mask, not a group's permissions: systemd 257's LoadCredential= (Debian 13) grants the
    service's user by a named entry, which reads as mode 0440 with no group or other access."""
    if not entries:
        return bool(st.st_mode & 0o077)
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), 0o7)
    return any((tag == _ACL_OTHER and perm) or (tag in (_ACL_GROUP_OBJ, _ACL_GROUP) and perm & mask)
               or (tag == _ACL_USER and ident != os.geteuid() and perm & mask) for tag, perm, ident in entries)


def canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the manifest without its signature, as sorted-key compact JSON."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _mac(key: SigningKey, manifest: dict[str, Any]) -> str:
    return hmac.new(key.secret, canonical(manifest), hashlib.sha256).hexdigest()


def sign(manifest: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    """`manifest` with its `signature` field set."""
    return {**manifest, "signature": {"algorithm": ALGORITHM, "key_id": key.key_id, "hmac": _mac(key, manifest)}}


def signature_problem(manifest: dict[str, Any], key: SigningKey, what: str = "checkpoint") -> tuple[str, str] | None:
    """(reason slug, message) when `manifest` (of a `what`) is not signed by `key`, else None."""
    sig = manifest.get("signature")
    if sig is None:
        return "unsigned", f"unsigned {what}: manifest.json has no signature"
    if not (isinstance(sig, dict) and set(sig) == {"algorithm", "key_id", "hmac"}
            and sig["algorithm"] == ALGORITHM and all(isinstance(sig[k], str) for k in ("key_id", "hmac"))):
        return "bad-signature", f"malformed signature in manifest.json (expected {ALGORITHM})"
    if not hmac.compare_digest(sig["key_id"].encode(), key.key_id.encode()):
        return "other-key", (f"signed with another key (key id {sig['key_id']}; the key at {key.path} has key id "
                             f"{key.key_id})")
    if not hmac.compare_digest(sig["hmac"].encode(), _mac(key, manifest).encode()):
        return "signature-mismatch", "signature mismatch: the manifest was changed after it was signed"
    return None
