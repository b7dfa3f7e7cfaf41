"""How the `sciproto` command reports a failure: what is wrong and what to do, in one or two
lines on stderr, and a non-zero exit status; the traceback only with `--debug`.

Every sub-command runs inside `run`, so a command added to the CLI gets the same handling
without code of its own: raise an exception whose message says what to fix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import grpc

from sciproto.errors import SciprotoError, from_rpc_error

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
DEBUG_HINT = "(run again with --debug for the traceback)"

# Status codes whose messages are better with a word on what to check.
_HINTS = {
    grpc.StatusCode.UNAVAILABLE: "is the server running at that address?",
    grpc.StatusCode.UNAUTHENTICATED: "pass a token (--token, or the *_access.token_* settings)",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the server is slow or stuck; raise the deadline or check its log",
}


def explain(error: BaseException) -> str:
    """The one-line (rarely a few lines) description of `error` shown to the user."""
    if isinstance(error, grpc.RpcError) and not isinstance(error, SciprotoError):
        error = from_rpc_error(error)  # type: ignore[arg-type]
    if isinstance(error, SciprotoError):
        hint = _HINTS.get(error.code)
        text = f"{error.message} ({error.code.name})"
        return f"{text}; {hint}" if hint and hint not in error.message else text
    if headline := getattr(error, "headline", None):  # e.g. ServerStartError: its one-line form
        return str(headline)
    message = str(error).strip()
    if isinstance(error, ValueError | OSError | LookupError | RuntimeError) and message:
        return message  # our own errors: the message is written for the user
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def run(invoke: Callable[[], Any], *, command: str, debug: bool = False) -> int:
    """Run the typer app (standalone: it reports bad options and --help itself) and return the
    exit status; any other exception becomes one line (or the traceback with `debug`)."""
    try:
        invoke()
    except SystemExit as stop:  # the app's own exit, or a component's SystemExit("message")
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        if debug:
            raise
        print(f"{command}: error: {explain(error)}", file=sys.stderr)
        print(DEBUG_HINT, file=sys.stderr)
        return EXIT_FAILED
    return 0


__all__ = ["DEBUG_HINT", "EXIT_FAILED", "EXIT_INTERRUPTED", "explain", "run"]
