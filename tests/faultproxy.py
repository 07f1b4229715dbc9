"""An HTTP proxy on 127.0.0.1 that forwards to the S3 server and injects faults.

``rules`` is a list of ``(predicate, action, times)``: the first rule whose predicate
matches ``(method, path_with_query)`` and still has ``times`` left decides the request.
Actions: "500" (an S3 InternalError reply), "503" (SlowDown), "drop" (read the request,
close the connection without a reply), "lose_reply" (forward the request, so the server
acts on it, then close the connection without a reply), "delay" (wait ``delay_s`` seconds, then forward: a
slow or shared store). Every request is logged in
``requests``, with its headers in ``headers``.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "expect", "host"}
_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
    "<Message>injected by the test proxy</Message></Error>"
)


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay_s = 0.0
        self.rules: list[list] = []
        self.requests: list[tuple[str, str]] = []
        self.headers: list[tuple[str, str, dict]] = []
        self.injected: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self._read_body()
                action = proxy._decide(self.command, self.path, dict(self.headers.items()))
                if action == "delay":
                    time.sleep(proxy.delay_s)
                    action = "pass"
                if action == "lose_reply":
                    self._forward(body, reply=False)
                if action in ("drop", "lose_reply"):
                    self.close_connection = True
                    self.connection.close()
                    return
                if action in ("500", "503"):
                    code = "InternalError" if action == "500" else "SlowDown"
                    self._reply(int(action), _ERROR_XML.format(code=code).encode(), {"Content-Type": "application/xml"})
                    return
                self._forward(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    raise RuntimeError("the test proxy does not speak chunked uploads")
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _forward(self, body: bytes, reply: bool = True) -> None:
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                headers["Host"] = self.headers.get("Host", "")
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                if not reply:
                    upstream.close()
                    return
                out = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_HEADERS | {"content-length"}}
                self._reply(response.status, data, out, head=self.command == "HEAD",
                            length=response.getheader("Content-Length"))
                upstream.close()

            def _reply(self, status: int, data: bytes, headers: dict, head: bool = False,
                       length: str | None = None) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", length if head and length else str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_rule(self, predicate: Callable[[str, str], bool], action: str, times: int = 1) -> None:
        self.rules.append([predicate, action, times])

    def _decide(self, method: str, path: str, headers: dict) -> str:
        with self._lock:
            self.requests.append((method, path))
            self.headers.append((method, path, headers))
            for rule in self.rules:
                predicate, action, times = rule
                if times > 0 and predicate(method, path):
                    rule[2] -= 1
                    self.injected.append((method, path, action))
                    return action
        return "pass"
