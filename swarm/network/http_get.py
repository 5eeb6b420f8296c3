"""An HTTP GET with a deadline for the whole body, for the manifest and the tokenizer a volunteer joins by URL.

urllib's timeout bounds each socket read, not the download: a server that sends a byte every few seconds would
hold a start for days. Reading with read1 (one socket read at most) lets the loop look at the clock between
reads, so the whole GET takes at most `timeout` plus one read's timeout.
"""

from __future__ import annotations

import time
import urllib.request

from swarm import __version__

CHUNK = 65536


class TooLargeError(ValueError):
    """The body is larger than the caller's limit."""


def http_get(url: str, timeout: float, max_bytes: int, accept: str = "*/*") -> bytes:
    """The body of a GET of `url`, at most `max_bytes` (TooLargeError past it), within about `timeout` seconds in
    all (TimeoutError past it). urllib's errors (HTTPError, URLError, OSError, ValueError) pass through."""
    request = urllib.request.Request(url, headers={"User-Agent": f"swarm/{__version__}", "Accept": accept})
    deadline = time.monotonic() + timeout
    body = bytearray()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} sent {len(body)} bytes in {timeout:g} s and was still sending")
            chunk = response.read1(CHUNK)
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > max_bytes:
                raise TooLargeError(f"{url} sent more than {max_bytes} bytes")
