"""The tokens a server accepts, kept current: token files are re-read when they change, so a token
is rotated (add the new line, move the clients, remove the old line) or revoked without a restart.

A token file that becomes unreadable or invalid is not ignored: its principal's calls are refused
until the file is fixed (fail closed), and the server logs why.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from sciproto.config import ConfigError
from sciproto.tokens import read_token, read_tokens

log = logging.getLogger("sciproto.auth")

Owner = TypeVar("Owner")
FileStamp = tuple[int, int, int]  # (mtime ns, size, inode): any change means a new file content


def token_digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps compare_digest's time independent
    # of the presented token's length as well as its content.
    return hashlib.sha256(token.encode()).digest()


def _stamp(path: Path) -> FileStamp | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size, status.st_ino


class FileWatch:
    """Says when a file has changed (or appeared, or gone) since it was last looked at, looking
    at most once every `check_interval_s`: one stat() per interval, none in between."""

    def __init__(self, path: Path, check_interval_s: float) -> None:
        self.path, self.check_interval_s = path, check_interval_s
        self._stamp = _stamp(path)
        self._next_check = time.monotonic() + check_interval_s

    def changed(self) -> bool:
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + self.check_interval_s
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


@dataclass(frozen=True)
class TokenSource(Generic[Owner]):
    """Where one principal's tokens are read: a file or an environment variable."""

    owner: Owner
    name: str  # the principal's name, for messages
    token_file: Path | None
    token_env: str | None


@dataclass(eq=False)
class _Loaded(Generic[Owner]):
    source: TokenSource[Owner]
    digests: list[bytes]
    watch: FileWatch | None  # None for an environment variable, read once


class TokenStore(Generic[Owner]):
    """Finds the owner of a presented token. Files are checked for changes at most once every
    `check_interval_s`, on lookup; environment variables are read once."""

    def __init__(self, sources: Sequence[TokenSource[Owner]], check_interval_s: float = 1.0) -> None:
        self._loaded: list[_Loaded[Owner]] = []
        for source in sources:  # at start-up a bad token stops the server: ConfigError propagates
            path = source.token_file
            watch = FileWatch(path, check_interval_s) if path is not None else None
            self._loaded.append(_Loaded(source, self._read(source), watch))
        self._pairs = self._index()

    def owners(self) -> list[Owner]:
        return [loaded.source.owner for loaded in self._loaded]

    def lookup(self, token: str) -> Owner | None:
        """The owner of `token`, or None. Every lookup compares against every token (no early
        exit), in constant time each, so timing tells nothing about which tokens exist."""
        self._reload_changed_files()
        presented = token_digest(token)
        found: Owner | None = None
        for digest, owner in self._pairs:
            if hmac.compare_digest(digest, presented):
                found = owner
        return found

    def _read(self, source: TokenSource[Owner]) -> list[bytes]:
        """The digests of the source's tokens; ConfigError if unreadable, invalid or shared."""
        owner = f"auth token of principal {source.name!r}"
        digests = [token_digest(token) for token in read_tokens(source.token_file, source.token_env, owner)]
        for other in self._loaded:
            if other.source is not source and any(hmac.compare_digest(a, b) for a in digests for b in other.digests):
                raise ConfigError(f"auth: principal {source.name!r} shares a token with principal "
                                  f"{other.source.name!r}; give each principal its own tokens")
        return digests

    def _index(self) -> list[tuple[bytes, Owner]]:
        return [(digest, loaded.source.owner) for loaded in self._loaded for digest in loaded.digests]

    def _reload_changed_files(self) -> None:
        changed = False
        for loaded in self._loaded:
            if loaded.watch is None or not loaded.watch.changed():
                continue
            changed = True
            try:
                loaded.digests = self._read(loaded.source)
            except ConfigError as error:
                loaded.digests = []
                log.error("%s; principal %r is refused until its token file is fixed", error, loaded.source.name)
            else:
                log.info("principal %r: token file %s changed; %d token(s) accepted now",
                         loaded.source.name, loaded.watch.path, len(loaded.digests))
        if changed:
            self._pairs = self._index()


class ClientToken:
    """The token a client sends, re-read from its file when the file changes (checked at most once
    every `check_interval_s`), so a client picks up a rotated token without a restart. A file that
    cannot be read keeps the last good token: the server decides whether it is still accepted."""

    def __init__(self, token_file: Path | None, token_env: str | None, owner: str,
                 check_interval_s: float = 1.0) -> None:
        self._file, self._env, self._owner = token_file, token_env, owner
        self._token = read_token(token_file, token_env, owner)  # fails fast at start-up
        self._watch = FileWatch(token_file, check_interval_s) if token_file is not None else None

    def current(self) -> str:
        if self._watch is not None and self._watch.changed():
            try:
                self._token = read_token(self._file, self._env, self._owner)
            except ConfigError as error:
                log.warning("%s; sending the previous token", error)
        return self._token
