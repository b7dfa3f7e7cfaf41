"""`sciproto view FILE`: a local page to browse rollouts.

It shows the rollouts of FILE, and of the failures file beside it
(`<stem>.failures.jsonl`) when there is one, in a table with filters and
sorting, a histogram of their rewards, and each rollout's transcript with its
tool calls and tool outputs. Nothing is fetched from the internet.

FILE is the rollout line format that `sciproto collect` writes and training
reads (schema `sciproto.rollout/1`, documented in `sciproto/client/rollouts.py`).
INFRA_ERROR rollouts (the environment failed, or servers were unreachable)
go to the failures file; the viewer shows them with their `error`.
"""

from __future__ import annotations

import signal
import threading
import webbrowser
from pathlib import Path

from clients.viewer.rollouts import RolloutIndex, failures_path_for
from clients.viewer.server import make_server

__all__ = ["main"]


def main(path: str | Path, port: int = 8765, open_browser: bool = False) -> None:
    """Serve the page for `path` on http://127.0.0.1:PORT/ until Ctrl-C or
    SIGTERM; port 0 picks a free port (the printed URL shows which)."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"no rollouts file at {path}: pass the JSONL that `sciproto collect` or `sciproto train` wrote")
    index = RolloutIndex(path)
    try:
        server = make_server(index, port)
    except OSError as error:
        raise SystemExit(f"cannot listen on 127.0.0.1:{port} ({error.strerror}): pick another --port, or 0 for any free one") from None
    # Reading a large file takes a while: the page can open meanwhile, its
    # first request waits for the index.
    threading.Thread(target=index.refresh, name="index rollouts", daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    failures = failures_path_for(path)
    shown = f"{path} and {failures.name}" if failures.exists() else str(path)
    print(f"Viewing rollouts from {shown} at {url} (Ctrl-C to stop)", flush=True)
    if threading.current_thread() is threading.main_thread():
        # shutdown() waits for serve_forever to return, so it must run on another thread
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    if open_browser:
        webbrowser.open(url)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
