"""CURVE keys for a group: one key pair for the client, one per engine rank.

The client binds, so it is the CURVE *server*; every engine is a CURVE client with a
key pair of its own. The client keeps an allow-list mapping each engine's public key to
exactly one rank, so a ZAP handler can tie a connection to the rank it claims: a stolen
engine key then buys one rank, not the group.

    from zmqdp.keys import generate_keys, load_client_keys, load_engine_keys

    generate_keys("/etc/zmqdp/g1", engines=2)      # or: python -m zmqdp keys DIR --engines 2
    client = load_client_keys("/etc/zmqdp/g1")     # on the client machine
    client.rank_of(zap_credentials)                # -> 0, 1 or None
    engine = load_engine_keys("/etc/zmqdp/g1", 1)  # on the machine of rank 1

The directory holds pyzmq certificate files (`zmq.auth.create_certificates`):
``client.key`` / ``client.key_secret`` and ``rank-<r>.key`` / ``rank-<r>.key_secret``.
Each machine needs only its part of it:

* the client machine: ``client.key_secret`` and every ``rank-<r>.key`` (public);
* the machine of engine r: ``rank-<r>.key_secret`` and ``client.key`` (public).

No secret leaves the machine that uses it, and the set of ``rank-*.key`` files on the
client machine *is* the allow-list. Secret files must be readable by their owner only;
like ssh, the loaders refuse them otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import zmq
import zmq.auth
from zmq.utils import z85

from .values import MAX_ENGINES, check_engines

__all__ = ["ClientKeys", "EngineKeys", "generate_keys", "load_client_keys", "load_engine_keys"]

CLIENT = "client"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"

_RANK_FILE = re.compile(r"rank-(?P<rank>.*)\.(?:key|key_secret)")
_CANONICAL_RANK = re.compile(r"0|[1-9][0-9]*")
_Z85_CHARS = frozenset(z85.Z85CHARS)


def _check_z85(key: object, what: str) -> bytes:
    """The key as Z85 bytes; a ValueError names `what` (never the key: it may be secret).

    A canonical round trip is required, so one key has one spelling and a dictionary
    lookup by Z85 cannot miss."""
    if not isinstance(key, bytes):
        raise ValueError(f"{what}: expected bytes, got {type(key).__name__}")
    if len(key) != 40:
        raise ValueError(f"{what}: expected a 40-character Z85 key, got {len(key)} bytes")
    if not _Z85_CHARS.issuperset(key):
        raise ValueError(f"{what}: not valid Z85 (a character outside the Z85 alphabet)")
    try:
        raw = z85.decode(key)
    except struct.error:  # a 5-character group above 2**32 - 1
        raise ValueError(f"{what}: not valid Z85 (a group exceeds 32 bits)") from None
    if z85.encode(raw) != key:
        raise ValueError(f"{what}: not valid Z85 (not in canonical form)")
    return key


def _check_pair(public: bytes, secret: bytes, what: str) -> None:
    """A secret key that does not produce the stored public key means an edited or mixed-up
    file; failing here beats a handshake that silently never completes."""
    _check_z85(public, f"{what}: public key")
    _check_z85(secret, f"{what}: secret key")
    if zmq.curve_public(secret) != public:
        raise ValueError(
            f"{what}: the public key does not belong to the secret key "
            "(edited or mixed-up file? regenerate with `python -m zmqdp keys`)"
        )


def _check_rank(rank: object, what: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"{what}: rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < MAX_ENGINES:
        raise ValueError(f"{what}: rank {rank} is outside 0..{MAX_ENGINES - 1}")
    return rank


@dataclass(frozen=True)
class ClientKeys:
    """What the client (the CURVE server) needs: its own key pair and the allow-list.

    Keys are Z85 bytes (40 characters), as libzmq socket options take them. Direct
    construction is validated like loading: the pair must match, ranks are 0..65535,
    every rank has one key and the client's own key is not in the list.
    """

    public: bytes
    secret: bytes
    allowed: Mapping[bytes, int] = field(hash=False)

    def __post_init__(self) -> None:
        _check_pair(self.public, self.secret, "client keys")
        if not isinstance(self.allowed, Mapping):
            raise ValueError(f"allowed: expected a mapping, got {type(self.allowed).__name__}")
        owner: dict[int, bytes] = {}
        for key, rank in self.allowed.items():
            _check_z85(key, "allowed: engine public key")
            _check_rank(rank, "allowed")
            if key == self.public:
                raise ValueError("allowed: the client's own public key is in the allow-list")
            if rank in owner:
                # One key per rank keeps the mapping a bijection: the ZAP handler can
                # then trust "this key is rank r" in both directions.
                raise ValueError(f"allowed: rank {rank} has more than one public key")
            owner[rank] = key
        # A private read-only copy: the caller's dict can change, the allow-list cannot.
        object.__setattr__(self, "allowed", MappingProxyType(dict(self.allowed)))

    def rank_of(self, key: bytes) -> int | None:
        """The rank an engine public key belongs to, or None if it is not allowed.

        Takes the raw 32-byte key (what a ZAP request carries as CURVE credentials) or
        its 40-character Z85 form; anything else is simply not allowed.
        """
        key = bytes(key)
        if len(key) == 32:
            key = z85.encode(key)
        elif len(key) != 40:
            return None
        return self.allowed.get(key)

    def ranks(self) -> list[int]:
        """The ranks the allow-list covers, ascending (compare with the group size)."""
        return sorted(self.allowed.values())

    def __repr__(self) -> str:
        return (
            f"ClientKeys(public={self.public!r}, secret=<hidden>, "
            f"allowed=<{len(self.allowed)} engine keys, ranks {self.ranks()}>)"
        )


@dataclass(frozen=True)
class EngineKeys:
    """What engine r needs: its own key pair and the client's (the server's) public key."""

    public: bytes
    secret: bytes
    server: bytes

    def __post_init__(self) -> None:
        _check_pair(self.public, self.secret, "engine keys")
        _check_z85(self.server, "engine keys: server (client) public key")
        if self.server == self.public:
            raise ValueError("engine keys: the engine's public key is the client's public key")

    def __repr__(self) -> str:
        return f"EngineKeys(public={self.public!r}, secret=<hidden>, server={self.server!r})"


def _rank_files(directory: Path) -> dict[Path, int]:
    """Every ``rank-*`` key file in `directory` with its rank.

    A name whose rank is not a plain decimal (``rank-O.key``, ``rank-01.key``) is an
    error rather than skipped: a skipped file is a rank silently left out of the
    allow-list."""
    found: dict[Path, int] = {}
    for entry in sorted(directory.iterdir()):
        match = _RANK_FILE.fullmatch(entry.name)
        if match is None:
            continue
        text = match["rank"]
        if not _CANONICAL_RANK.fullmatch(text):
            raise ValueError(
                f"{entry}: {text!r} is not a decimal rank; expected rank-<r>.key or "
                "rank-<r>.key_secret with r = 0, 1, ... (rename or remove the file)"
            )
        found[entry] = _check_rank(int(text), str(entry))
    return dict(sorted(found.items(), key=lambda item: (item[1], item[0].name)))


def _existing_dir(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such key directory")
    _check_trusted(path, "key directory")
    return path


def _check_trusted(path: Path, what: str) -> None:
    """Refuse a key file or directory that someone else may write, as ssh does for
    ``authorized_keys``: whoever can add a ``rank-<r>.key`` to the directory, or replace
    ``client.key``, adds a rank to the allow-list or impersonates the client. Trusted
    means owned by this user (or root) and not writable by group or others."""
    if os.name != "posix":
        return
    info = path.stat()
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise PermissionError(
            f"{path}: {what} is writable by group/others (mode {mode:04o}), so anyone "
            f"there could add or replace a key; restrict it with: chmod go-w {path}"
        )
    if info.st_uid not in (os.getuid(), 0):
        raise PermissionError(
            f"{path}: {what} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.getuid()}) or root, so its owner could add or replace a key"
        )


def _read_public(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing public key file")
    _check_trusted(path, "public key file")
    public, _ = _load(path)
    return _check_z85(public, str(path))


def _read_secret(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a secret file, refusing one others can read, as ssh does: a
    key that may have leaked is not one to keep using without anyone noticing."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing secret key file")
    mode = stat.S_IMODE(path.stat().st_mode)
    if os.name == "posix" and mode & 0o077:
        raise PermissionError(
            f"{path}: secret key file is accessible by group/others (mode {mode:04o}); "
            f"restrict it with: chmod 600 {path}"
        )
    public, secret = _load(path)
    if secret is None:
        raise ValueError(f"{path}: no secret-key line (is this a public .key file?)")
    _check_pair(public, secret, str(path))
    return public, secret


def _check_public_copy(path: Path, public: bytes, secret_file: Path) -> None:
    """Where a public file sits next to its secret file (the machine that generated the
    keys), they must agree: otherwise the peer's allow-list and this side's key differ
    and the handshake fails with nothing but a ZAP rejection to show for it."""
    if path.is_file() and _read_public(path) != public:
        raise ValueError(f"{path} and {secret_file} hold different public keys")


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except ValueError:
        raise ValueError(f"{path}: no public-key line (not a zmq certificate file?)") from None


def load_client_keys(directory: str | os.PathLike[str]) -> ClientKeys:
    """The client's key pair (``client.key_secret``) and the allow-list built from every
    ``rank-<r>.key`` in `directory`; other files are ignored, secret rank files included."""
    path = _existing_dir(directory)
    secret_file = path / f"{CLIENT}{SECRET_SUFFIX}"
    public, secret = _read_secret(secret_file)
    _check_public_copy(path / f"{CLIENT}{PUBLIC_SUFFIX}", public, secret_file)
    allowed: dict[bytes, int] = {}
    where: dict[bytes, Path] = {}
    for file, rank in _rank_files(path).items():
        if file.suffix != PUBLIC_SUFFIX:
            continue
        key = _read_public(file)
        if key == public:
            raise ValueError(f"{file}: holds the client's own public key, not an engine's")
        if key in allowed:
            raise ValueError(
                f"{where[key]} and {file} hold the same public key; every rank needs a "
                "key pair of its own (regenerate with `python -m zmqdp keys --force`)"
            )
        allowed[key] = rank
        where[key] = file
    return ClientKeys(public=public, secret=secret, allowed=allowed)


def load_engine_keys(directory: str | os.PathLike[str], rank: int) -> EngineKeys:
    """Engine `rank`'s key pair (``rank-<r>.key_secret``) and the client's public key
    (``client.key``): all an engine machine needs, and all it should have."""
    rank = _check_rank(rank, "load_engine_keys")
    path = _existing_dir(directory)
    own = path / f"rank-{rank}{SECRET_SUFFIX}"
    public, secret = _read_secret(own)
    _check_public_copy(path / f"rank-{rank}{PUBLIC_SUFFIX}", public, own)
    server_file = path / f"{CLIENT}{PUBLIC_SUFFIX}"
    server = _read_public(server_file)
    if server == public:
        raise ValueError(f"{own} and {server_file} hold the same public key")
    return EngineKeys(public=public, secret=secret, server=server)


def generate_keys(
    directory: str | os.PathLike[str], engines: int, *, force: bool = False
) -> list[Path]:
    """Write fresh key pairs for the client and ranks 0..engines-1; return the files.

    A new directory is created with mode 0700 (an existing one keeps its mode); secret
    files get mode 0600. All keys are written into a private (0700) staging directory
    first and then renamed into place, so a secret file is never readable by others, not
    even for a moment, and a failure while generating leaves the directory as it was.

    Existing key files are never replaced silently (a lost secret cannot be recovered,
    and new keys lock out every machine holding the old ones): FileExistsError, unless
    `force`. With `force`, ``rank-<r>`` files of ranks >= `engines` are removed too, so
    a smaller group does not keep stale engines on its allow-list.
    """
    engines = check_engines(engines)
    path = Path(directory)
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
        path.chmod(0o700)  # mkdir's mode is filtered by the umask
    elif not path.is_dir():
        raise NotADirectoryError(f"{path}: not a directory")

    names = [CLIENT, *(f"rank-{r}" for r in range(engines))]
    targets = [path / f"{n}{suffix}" for n in names for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX)]
    stale = [f for f in _rank_files(path) if f not in targets]
    existing = [f for f in targets if f.exists() or f.is_symlink()] + stale
    if existing and not force:
        raise FileExistsError(
            f"{existing[0]}: key file exists"
            + (f" (and {len(existing) - 1} more)" if len(existing) > 1 else "")
            + "; refusing to replace keys (use --force / force=True to regenerate all)"
        )

    staging = Path(tempfile.mkdtemp(prefix=".zmqdp-keys-", dir=path))  # mode 0700
    try:
        for name in names:
            public_file, secret_file = zmq.auth.create_certificates(staging, name)
            os.chmod(secret_file, 0o600)
            os.chmod(public_file, 0o644)
        for file in stale:
            file.unlink()
        for target in targets:
            os.replace(staging / target.name, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return targets
