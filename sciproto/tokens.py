"""Bearer tokens read from a file or an environment variable, never from a
config literal, so that configs can be committed and shared safely."""

from __future__ import annotations

import os
from pathlib import Path

from sciproto.config import ConfigError

# 16 characters of a URL-safe random string carry ~96 bits; anything shorter
# is guessable by a patient client.
MIN_TOKEN_CHARS = 16
GENERATE_HINT = 'generate one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'


def read_tokens(token_file: Path | None, token_env: str | None, owner: str) -> list[str]:
    """The tokens in `token_file`, one per line (blank lines and `#` comments
    skipped; several tokens let a rotation overlap old and new), or the one in
    the environment variable `token_env`; exactly one source must be given.
    `owner` names the setting in error messages (a token never appears)."""
    if (token_file is None) == (token_env is None):
        raise ConfigError(f"{owner}: give exactly one of token_file or token_env")
    if token_file is not None:
        try:
            lines = token_file.read_text().splitlines()
        except OSError as error:
            raise ConfigError(f"{owner}: cannot read token_file {token_file}: {error.strerror}") from error
        source = f"token_file {token_file}"
        tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not tokens:
            raise ConfigError(f"{owner}: {source} holds no token; " + GENERATE_HINT)
    else:
        assert token_env is not None
        if token_env not in os.environ:
            raise ConfigError(f"{owner}: environment variable {token_env} (token_env) is not set")
        tokens = [os.environ[token_env].strip()]
        source = f"environment variable {token_env}"
    for token in tokens:
        _check_token(token, source, owner)
    return tokens


def read_token(token_file: Path | None, token_env: str | None, owner: str) -> str:
    """The token a client sends: the first of `read_tokens`."""
    return read_tokens(token_file, token_env, owner)[0]


def _check_token(token: str, source: str, owner: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{owner}: the token in {source} has fewer than {MIN_TOKEN_CHARS} characters; "
                          + GENERATE_HINT)
    # gRPC metadata values must be printable ASCII; a space would split "Bearer <token>".
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ConfigError(f"{owner}: the token in {source} must be printable ASCII without spaces; "
                          + GENERATE_HINT)
