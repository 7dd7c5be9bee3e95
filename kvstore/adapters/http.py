"""The one way kvstore's HTTP routes answer with JSON (on mlx_lm.server's ``APIHandler``)."""

from __future__ import annotations

import json
from typing import Any


def send_json(handler: Any, status: int, obj: Any, *, headers: dict[str, str] | None = None,
              close: bool = False) -> None:
    """Write ``obj`` as a complete JSON response: status, Content-Type, Content-Length,
    any extra ``headers``, and with ``close`` the connection marked to close after it."""
    body = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    if close:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    handler.wfile.write(body)
