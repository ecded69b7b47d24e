"""The completions client against a small local server that speaks the streaming protocol."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvlab.client import complete


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (the http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"auth": self.headers.get("Authorization"), "body": body})
        if self.server.key and self.headers.get("Authorization") != f"Bearer {self.server.key}":  # type: ignore[attr-defined]
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error": "Unauthorized"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        ids = body.get("return_token_ids")  # as vLLM: each streamed choice carries its token ids
        events = [
            {"choices": [{"text": "a", **({"token_ids": [41]} if ids else {})}]},
            {"choices": [{"text": "b", **({"token_ids": [42]} if ids else {})}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                      "prompt_tokens_details": {"cached_tokens": 2}}},
        ]
        for e in events:
            self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.key = "s3cret"  # type: ignore[attr-defined]
    _Handler.seen = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_key_from_the_environment_reaches_the_engine(server, monkeypatch) -> None:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="HTTP 401"):
        complete(url, "m", [1, 2, 3], max_tokens=2)
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    c = complete(url, "m", [1, 2, 3], max_tokens=2, cache_salt="tenant-a")
    assert (c.text, c.prompt_tokens, c.cached_tokens, c.output_tokens) == ("ab", 3, 2, 2)
    assert _Handler.seen[-1]["auth"] == "Bearer s3cret"
    assert _Handler.seen[-1]["body"]["prompt"] == [1, 2, 3]
    assert _Handler.seen[-1]["body"]["cache_salt"] == "tenant-a"


def test_the_generated_token_ids_come_back_where_asked_for(server, monkeypatch) -> None:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    assert complete(url, "m", [1, 2, 3], max_tokens=2).token_ids is None
    assert "return_token_ids" not in _Handler.seen[-1]["body"]
    assert complete(url, "m", [1, 2, 3], max_tokens=2, return_token_ids=True).token_ids == [41, 42]
    assert _Handler.seen[-1]["body"]["return_token_ids"] is True
