"""swarm-monitor's web server: the page, its static files, and the API, from the monitor's current state.

The standard library's threading HTTP server, in a daemon thread: each request reads the latest state (swapped
in whole by the sampler, under a lock) or queries the history. Every file the page loads comes from here
(plotly's JavaScript from plotly's own package), so the page works with no internet; a Content-Security-Policy
forbids anything else. A request that fails gets a 500 and a log line; it never stops the server.

Routes: / (the page), /static/<file>, /api/v1/state, /api/v1/history?window=hour|day|week|all,
/api/v1/leaderboard, /metrics, /healthz.
"""

from __future__ import annotations

import errno
import gzip
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from swarm.errors import HistoryError, PeerStartError
from swarm.monitor.history import WINDOWS, History
from swarm.monitor.leaderboard import Leaderboard
from swarm.monitor.prometheus import swarm_metrics

logger = logging.getLogger(__name__)

PAGE_FILES = {"monitor.js": "text/javascript", "monitor.css": "text/css"}
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; script-src 'self'"
# the verdict as an HTTP status, like peer-status' exit codes 0 / 1 / 2
HEALTHZ_STATUS = {"healthy": HTTPStatus.OK, "degraded": HTTPStatus.SERVICE_UNAVAILABLE,
                  "unreachable": HTTPStatus.GATEWAY_TIMEOUT}  # fmt: skip


@dataclass
class MonitorState:
    """What the sampler last saw; replaced whole under `lock`, read by the request threads."""

    document: dict[str, Any]
    reachable: bool = True
    error: str = ""  # why the last read failed, if it did
    last_read: float = field(default_factory=time.time)  # when the swarm was last found
    lock: threading.Lock = field(default_factory=threading.Lock)

    def update(self, document: dict[str, Any], reachable: bool, error: str = "") -> None:
        with self.lock:
            self.document, self.reachable, self.error = document, reachable, error
            if reachable:
                self.last_read = time.time()

    def status(self) -> str:
        if not self.reachable:
            return "unreachable"
        return "healthy" if self.document["health"]["healthy"] else "degraded"

    def state_document(self) -> dict[str, Any]:
        """peer-status' document, with what the monitor adds under "monitor"."""
        with self.lock:
            monitor = {"status": self.status(), "reachable": self.reachable, "error": self.error,
                       "last_read": self.last_read}  # fmt: skip
            return {**self.document, "monitor": monitor}


def _static_files() -> dict[str, tuple[str, bytes, bytes]]:
    """name -> (content type, bytes, gzipped bytes): compressed once, served to every browser that accepts it."""
    files = {}
    page = resources.files("swarm.monitor") / "page"
    for name, content_type in (("index.html", "text/html; charset=utf-8"), *PAGE_FILES.items()):
        files[name] = (content_type, (page / name).read_bytes())
    files["plotly.min.js"] = ("text/javascript", plotly_javascript())
    return {name: (kind, body, gzip.compress(body, 6)) for name, (kind, body) in files.items()}


def plotly_javascript() -> bytes:
    """plotly.js as plotly's Python package ships it; PeerStartError if the package is missing."""
    try:
        import plotly
    except ImportError:
        raise PeerStartError("swarm-monitor draws its plots with plotly: pip install 'plotly>=5,<8'") from None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise PeerStartError(f"plotly {plotly.__version__} has no {path}: reinstall it (pip install 'plotly>=5,<8')")
    return path.read_bytes()


class MonitorServer:
    """The HTTP server over `state`, `history` and `leaderboard`, in a daemon thread."""

    def __init__(self, state: MonitorState, history: History, leaderboard: Leaderboard, host: str, port: int):
        self.state, self.history, self.leaderboard = state, history, leaderboard
        self.files = _static_files()
        handler = type("Handler", (_Handler,), {"monitor": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PeerStartError(
                    f"port {port} on {host} is in use; pass another --port (0: any free one)"
                ) from None
            raise PeerStartError(f"cannot serve the page on {host}:{port} ({e}); check --host and --port") from None
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="monitor-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host if ':' not in str(host) else f'[{host}]'}:{port}/"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    monitor: MonitorServer
    server_version = "swarm-monitor"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        try:
            self.route()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away
        except Exception:
            logger.exception("the monitor failed to answer %s", self.path)
            try:
                self.send_json({"error": "internal error; see the monitor's log"}, HTTPStatus.INTERNAL_SERVER_ERROR)
            except OSError:
                pass

    def route(self) -> None:
        url = urlsplit(self.path)
        path = url.path
        monitor = self.monitor
        if path in ("/", "/index.html"):
            self.send_file("index.html")
        elif path.startswith("/static/") and path[len("/static/") :] in monitor.files:
            self.send_file(path[len("/static/") :], cache=True)
        elif path == "/api/v1/state":
            self.send_json(monitor.state.state_document())
        elif path == "/api/v1/history":
            window = parse_qs(url.query).get("window", ["hour"])[0]
            if window not in WINDOWS:
                self.send_json({"error": f"unknown window {window!r}; use one of {', '.join(WINDOWS)}"}, 400)
                return
            try:
                self.send_json(monitor.history.series(window, time.time()))
            except HistoryError as e:
                self.send_json({"error": str(e)}, HTTPStatus.SERVICE_UNAVAILABLE)
        elif path == "/api/v1/leaderboard":
            self.send_json({"volunteers": monitor.leaderboard.rows()})
        elif path == "/metrics":
            state = monitor.state
            with state.lock:
                document, reachable = state.document, state.reachable
            body = swarm_metrics(document, reachable, monitor.history.sample_count())
            self.send_body(body, "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/healthz":
            status = monitor.state.status()
            self.send_json({"status": status, "exit_code": list(HEALTHZ_STATUS).index(status)}, HEALTHZ_STATUS[status])
        else:
            self.send_json({"error": f"no such page: {path}"}, HTTPStatus.NOT_FOUND)

    def send_file(self, name: str, cache: bool = False) -> None:
        content_type, body, compressed = self.monitor.files[name]
        gzipped = "gzip" in self.headers.get("Accept-Encoding", "")
        headers = {"Content-Encoding": "gzip"} if gzipped else {}
        if cache:
            headers["Cache-Control"] = "max-age=3600"
        self.send_body(compressed if gzipped else body, content_type, headers=headers)

    def send_json(self, document: Any, status: int = HTTPStatus.OK) -> None:
        try:
            body = json.dumps(document, allow_nan=False, default=str).encode()
        except ValueError:  # a NaN or infinity: JSON has none, and a browser's parser would refuse the document
            body = json.dumps(_finite(document), allow_nan=False, default=str).encode()
        self.send_body(body, "application/json", status, {"Cache-Control": "no-store"})

    def send_body(self, body: bytes, content_type: str, status: int = HTTPStatus.OK, headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
