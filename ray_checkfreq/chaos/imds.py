"""A stand-in for EC2's instance metadata service (IMDSv2) on 127.0.0.1, for spot notices.

    with MetadataService() as imds:
        url = imds.base_url("node-a")        # the watcher's RCF_IMDS_URL for that node
        imds.announce("node-a", deadline_epoch_s=time.time() + 30)

What ``cluster/spot_notice_watcher.sh`` reads, answered as EC2 answers it:

- ``PUT {base}/latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``: a token;
- ``GET {base}/latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``:
  401 without a valid token (missing, unknown or expired), 404 while no interruption is
  announced, else ``{"action": "terminate", "time": "<UTC, ISO 8601 to the second>Z"}``.

Each node has a base of its own (``/node/<name>``), so one server answers a whole local
cluster. ``expire_tokens()`` ends every token handed out, as their TTL would. Another
process (the chaos harness) announces with ``announce_over_http(url, node, deadline)``:
``POST /control/notice/<node>`` with the deadline (epoch seconds) as its body.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
MAX_TTL_S = 21600  # what EC2 allows


class MetadataService:
    """The IMDSv2 stand-in (module docstring); a context manager that serves on a free port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}  # token -> expiry (time.time())
        self._notices: dict[str, float] = {}  # node -> announced interruption (epoch seconds)
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status), for tests
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MetadataService:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="rcf-imds", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def base_url(self, node: str) -> str:
        """What the watcher on ``node`` takes as its metadata address (``RCF_IMDS_URL``)."""
        _check_node(node)
        return f"http://127.0.0.1:{self.port}/node/{node}"

    def announce(self, node: str, *, deadline_epoch_s: float) -> None:
        """From now on ``node``'s metadata announces an interruption at ``deadline_epoch_s``."""
        _check_node(node)
        with self._lock:
            self._notices[node] = deadline_epoch_s

    def expire_tokens(self) -> None:
        with self._lock:
            self._tokens.clear()

    # ------------------------------------------------------------- answers
    def new_token(self, ttl_header: str | None) -> tuple[int, bytes]:
        try:
            ttl = int(ttl_header or "")
        except ValueError:
            return 400, b"missing or bad X-aws-ec2-metadata-token-ttl-seconds"
        if not 1 <= ttl <= MAX_TTL_S:
            return 400, b"ttl out of range"
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._tokens[token] = time.time() + ttl
        return 200, token.encode()

    def notice(self, node: str, token: str | None) -> tuple[int, bytes]:
        with self._lock:
            valid = token is not None and self._tokens.get(token, 0.0) > time.time()
            deadline = self._notices.get(node)
        if not valid:
            return 401, b""
        if deadline is None:
            return 404, b""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))
        return 200, json.dumps({"action": "terminate", "time": when}).encode()


def _check_node(node: str) -> None:
    if not node or "/" in node:
        raise ValueError(f"node={node!r}: a non-empty name without '/'")


def _handler_for(service: MetadataService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            node, path = _split(self.path)
            if node is None or path != TOKEN_PATH:
                self._answer(404, b"")
            else:
                self._answer(*service.new_token(self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")))

        def do_GET(self) -> None:
            node, path = _split(self.path)
            if node is None or path != NOTICE_PATH:
                self._answer(404, b"")
            else:
                self._answer(*service.notice(node, self.headers.get("X-aws-ec2-metadata-token")))

        def do_POST(self) -> None:  # the harness's control: announce a notice
            prefix = "/control/notice/"
            try:
                node = self.path[len(prefix):] if self.path.startswith(prefix) else ""
                length = int(self.headers.get("Content-Length") or 0)
                service.announce(node, deadline_epoch_s=float(self.rfile.read(min(length, 64))))
            except ValueError as err:
                self._answer(400, str(err).encode())
                return
            self._answer(200, b"")

        def _answer(self, status: int, body: bytes) -> None:
            service.requests.append((self.command, self.path, status))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _split(path: str) -> tuple[str | None, str]:
    """``/node/<name>/rest`` -> (name, /rest); anything else -> (None, path)."""
    parts = path.split("/", 3)
    if len(parts) < 4 or parts[1] != "node" or not parts[2]:
        return None, path
    return parts[2], "/" + parts[3]


def announce_over_http(url: str, node: str, *, deadline_epoch_s: float) -> None:
    """Announce an interruption of ``node`` to the stand-in serving at ``url`` (http://host:port)."""
    import urllib.request

    request = urllib.request.Request(f"{url}/control/notice/{node}", data=repr(deadline_epoch_s).encode(),
                                     method="POST")
    urllib.request.urlopen(request, timeout=5).read()
