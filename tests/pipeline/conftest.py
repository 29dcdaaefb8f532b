"""A real HTTP receiver for the notifications the pipeline sends through Apprise (its `json://` scheme)."""

from __future__ import annotations

import http.server
import json
import threading

import pytest


@pytest.fixture
def receiver():
    received: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"json://127.0.0.1:{server.server_address[1]}/", received
    server.shutdown()
