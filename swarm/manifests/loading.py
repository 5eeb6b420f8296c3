"""Getting a manifest from where --join points (a file, or an http(s) URL), and writing one.

A URL may carry the swarm id as its fragment, checked against the content; both a file and a URL's body are
limited to MAX_MANIFEST_BYTES, and a URL to URL_TIMEOUT seconds in all. A private swarm's manifest names its
secret file, which is read here too (`with_secret`). What a manifest holds is swarm/manifests/manifest.py's, its
validation swarm/manifests/validation.py's.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.error
import urllib.request
from pathlib import Path

from swarm.errors import ManifestError
from swarm.files import atomic_write
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import parse_manifest
from swarm.network.http_get import TooLargeError, http_get
from swarm.trust.secret import read_secret

MAX_MANIFEST_BYTES = 1_000_000
URL_TIMEOUT = 15.0  # seconds to fetch a manifest by URL, in all


def load_manifest(source: str | Path, timeout: float = URL_TIMEOUT) -> Manifest:
    """Read and validate a manifest from a file or an http(s) URL.

    A URL may carry the swarm id as its fragment (`https://example.org/swarm.json#<swarm id>`): the manifest's
    content must then hash to it, so that a tampered or outdated copy is refused. Every failure is a
    ManifestError that says what went wrong, within `timeout` seconds for a URL."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        url, expected_id = _split_swarm_id(text)
        body = _fetch(url, timeout)
        try:
            manifest = parse_manifest(body, origin="the document")
        except ManifestError as e:
            raise ManifestError(f"{url} does not hold a valid swarm manifest: {e}") from None
        if expected_id is not None and manifest.swarm_id != expected_id:
            raise ManifestError(
                f"the manifest at {url} has swarm id {manifest.swarm_id}, but the URL says {expected_id}: it was "
                "changed since the URL was published (or the URL is wrong); ask the swarm's creator for the "
                "current URL"
            )
        manifest = dataclasses.replace(manifest, origin=url)
        return with_secret(manifest, Path.cwd(), from_url=True)
    path = Path(source)
    manifest = dataclasses.replace(_load_manifest_file(path), origin=str(path.parent.resolve()))
    return with_secret(manifest, path.parent)


def with_secret(manifest: Manifest, base: Path, from_url: bool = False) -> Manifest:
    """The manifest with its secret loaded, if it names a secret file (a relative path is relative to `base`:
    the manifest file's folder, or the current folder for a manifest from a URL). A manifest from a URL may
    name only a file in the current folder or below it: it must not make any file of this machine (a key,
    say) the swarm's secret."""
    if not manifest.private:
        return manifest
    named = Path(manifest.network.secret_file)
    if from_url and not confined(str(named)):
        raise ManifestError(
            f"network.secret_file {str(named)[:200]!r}: a manifest from a URL may name only a file in the current "
            "folder (or below it); download the manifest and keep it next to the secret file instead"
        )
    path = base / named.expanduser()
    return dataclasses.replace(manifest, secret=read_secret(path))


def confined(name: str) -> bool:
    """Whether `name` is a relative path that stays in its folder: all that a manifest from a URL or from a peer
    may name on this machine (a secret file, a tokenizer, a pretrained folder), so that it cannot make this peer
    read any file it likes."""
    path = Path(name)
    return not (path.is_absolute() or ".." in path.parts or name.startswith("~"))


def _split_swarm_id(url: str) -> tuple[str, str | None]:
    """(url without fragment, the swarm id its fragment names, if any)."""
    base, _, fragment = url.partition("#")
    if not fragment:
        return base, None
    swarm_id = fragment.removeprefix("swarm_id=")
    if not re.fullmatch(r"[0-9a-f]{16}", swarm_id):
        raise ManifestError(
            f"the URL's fragment #{fragment[:40]} is not a swarm id (16 hex digits, e.g. #0123456789abcdef); "
            "drop it or copy the URL again"
        )
    return base, swarm_id


def _fetch(url: str, timeout: float) -> str:
    """The body of an HTTP GET, at most MAX_MANIFEST_BYTES, within `timeout` seconds in all."""
    try:
        body = http_get(url, timeout, MAX_MANIFEST_BYTES, accept="application/json")
    except TooLargeError:
        raise ManifestError(f"{url} sent more than {MAX_MANIFEST_BYTES} bytes; that is not a manifest") from None
    except urllib.error.HTTPError as e:
        raise ManifestError(
            f"could not get the manifest: the server at {url} answered HTTP {e.code} ({e.reason}); check the URL"
        ) from None
    except TimeoutError:
        raise ManifestError(
            f"could not get the manifest: {url} did not send it within {timeout:g} seconds; check the URL and "
            "that the server is up"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise ManifestError(
                f"could not get the manifest: {url} did not answer within {timeout:g} seconds; check the URL and "
                "that the server is up"
            ) from None
        raise ManifestError(f"could not get the manifest from {url}: {reason}; check the URL") from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{url} did not send text (not UTF-8); that is not a manifest") from None


def _load_manifest_file(path: Path) -> Manifest:
    """Read and validate a manifest file."""
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest {path} is larger than {MAX_MANIFEST_BYTES} bytes; is it really a manifest?")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"manifest file {path} does not exist; pass the path or URL of a swarm manifest") from None
    except IsADirectoryError:
        raise ManifestError(f"{path} is a folder; pass the path or URL of a swarm manifest") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"cannot read manifest {path}: {e}") from None
    return parse_manifest(text, origin=str(path))


def write_manifest(manifest: Manifest, path: Path) -> None:
    """Write a manifest atomically (a reader never sees half a file); ManifestError if that is impossible."""
    try:
        atomic_write(path, manifest.to_json())
    except OSError as e:
        raise ManifestError(f"cannot write the manifest to {path}: {e.strerror or e}") from None
