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


def read_token(token_file: Path | None, token_env: str | None, owner: str) -> str:
    """The token in `token_file` (surrounding whitespace dropped) or in the
    environment variable `token_env`; exactly one must be given. `owner`
    names the setting in error messages (the token itself never appears)."""
    if (token_file is None) == (token_env is None):
        raise ConfigError(f"{owner}: give exactly one of token_file or token_env")
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as error:
            raise ConfigError(f"{owner}: cannot read token_file {token_file}: {error.strerror}") from error
        source = f"token_file {token_file}"
    else:
        assert token_env is not None
        if token_env not in os.environ:
            raise ConfigError(f"{owner}: environment variable {token_env} (token_env) is not set")
        token = os.environ[token_env].strip()
        source = f"environment variable {token_env}"
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{owner}: the token in {source} has fewer than {MIN_TOKEN_CHARS} characters; "
                          + GENERATE_HINT)
    # gRPC metadata values must be printable ASCII; a space would split "Bearer <token>".
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ConfigError(f"{owner}: the token in {source} must be printable ASCII without spaces; "
                          + GENERATE_HINT)
    return token
