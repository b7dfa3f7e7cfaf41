"""The viewer's HTTP server: the page, its script and style, and the rollouts
as JSON. Standard library only; it binds loopback, and serves no file but its
own three.

    GET /                          the page
    GET /static/viewer.{js,css}
    GET /api/summary               files, row count, lines that could not be read
    GET /api/rollouts?offset=&limit=
                                   a page of table rows; offset 0 re-reads appended lines
    GET /api/rollout?key=rollouts:12
                                   one whole rollout for its transcript
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from clients.viewer.rollouts import RolloutIndex

log = logging.getLogger("sciproto.viewer")

STATIC = Path(__file__).with_name("static")
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/viewer.js": ("viewer.js", "text/javascript; charset=utf-8"),
    "/static/viewer.css": ("viewer.css", "text/css; charset=utf-8"),
}
MAX_PAGE = 5000


class BadRequest(ValueError):
    """A query the API cannot answer; the message says what to send instead."""


def _int_param(query: dict[str, list[str]], name: str, default: int, low: int, high: int) -> int:
    raw = query.get(name, [str(default)])[0]
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise BadRequest(f"{name}={value} is out of range: use {low}..{high}")
    return value


class ViewerHandler(BaseHTTPRequestHandler):
    index: RolloutIndex  # set on the subclass `make_server` builds

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        try:
            if url.path in ASSETS:
                name, content_type = ASSETS[url.path]
                self._send(HTTPStatus.OK, (STATIC / name).read_bytes(), content_type)
            elif url.path == "/api/summary":
                self._send_json(HTTPStatus.OK, self.index.summary())
            elif url.path == "/api/rollouts":
                offset = _int_param(query, "offset", 0, 0, 2**31)
                if offset == 0:
                    self.index.refresh()
                self._send_json(HTTPStatus.OK, self.index.page(offset, _int_param(query, "limit", 1000, 1, MAX_PAGE)))
            elif url.path == "/api/rollout":
                self._send_json(HTTPStatus.OK, self.index.record(query.get("key", [""])[0]))
            else:
                self._send_json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path}: open / instead"})
        except BadRequest as error:
            self._send_json(HTTPStatus.BAD_REQUEST, {"error": str(error)})
        except KeyError as error:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": error.args[0]})
        except (OSError, ValueError) as error:  # the file vanished or a line changed under us
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(error).__name__}: {error}"})

    def _send_json(self, status: HTTPStatus, body: Any) -> None:
        self._send(status, json.dumps(body, ensure_ascii=False, allow_nan=False).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def make_server(index: RolloutIndex, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server bound to host:port (0 picks a free port), not yet serving."""
    handler = type("BoundViewerHandler", (ViewerHandler,), {"index": index})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
