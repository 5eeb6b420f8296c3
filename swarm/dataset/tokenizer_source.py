"""Where a peer gets its swarm's tokenizer: the manifest pins a tokenizer.json by SHA-256 (`data.tokenizer`,
`data.tokenizer_sha256`), and any copy whose hash matches will do.

Looked for in this order: this machine's tokenizer cache (`$SWARM_CACHE_DIR/tokenizers/<sha256>.json`), the file
next to the manifest (or, for a manifest from a URL, the URL next to it), then the swarm's running peers, which
hand out the copy they hold (`rpc_tokenizer`, in chunks: asked by swarm/client/rpc.py, `tokenizer_from_peers`). A
copy whose hash differs is refused; a good one is kept in the cache, from which this peer hands it out in turn.
"""

from __future__ import annotations

import hashlib
import logging
import urllib.parse
import urllib.request
from pathlib import Path

from swarm.dataset.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer
from swarm.errors import TokenizerError
from swarm.files import atomic_write, cache_root
from swarm.manifests.loading import confined
from swarm.manifests.manifest import Manifest
from swarm.network.http_get import TooLargeError, http_get

logger = logging.getLogger(__name__)

MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # Llama 3's tokenizer.json is 9 MB
URL_TIMEOUT = 30.0


def cache_folder() -> Path:
    return cache_root() / "tokenizers"


def cached_path(sha256: str) -> Path:
    return cache_folder() / f"{sha256}.json"


def store(data: bytes, sha256: str) -> Path:
    """Keep a checked tokenizer file in the cache (TokenizerError if its hash is not `sha256`)."""
    check_hash(data, sha256, "the tokenizer received")
    path = cached_path(sha256)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
    return path


def check_hash(data: bytes, sha256: str, what: str) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise TokenizerError(
            f"{what} has SHA-256 {actual[:16]}..., but the swarm's manifest pins {sha256[:16]}...: it is another "
            "tokenizer (or a changed copy); get the swarm's own tokenizer.json"
        )


def local_tokenizer(manifest: Manifest) -> Tokenizer | None:
    """The swarm's tokenizer from this machine or the manifest's own location; None if neither has it (then ask
    the swarm's peers: swarm/client/rpc.py, `tokenizer_from_peers`). The byte vocabulary needs no file."""
    data = manifest.data
    if not data.tokenizer:
        return byte_tokenizer()
    cached = cached_path(data.tokenizer_sha256)
    if cached.is_file():
        try:
            check_hash(cached.read_bytes(), data.tokenizer_sha256, f"the cached tokenizer {cached}")
            return load_tokenizer(cached)
        except TokenizerError as e:
            logger.warning(f"{e}; fetching it again")
    body = _next_to_manifest(manifest)
    if body is None:
        return None
    return load_tokenizer(store(body, data.tokenizer_sha256))


def is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def _next_to_manifest(manifest: Manifest) -> bytes | None:
    """The tokenizer file the manifest names, if it is where the manifest says and has the pinned hash; None
    otherwise (a missing, unreachable or different file: the swarm's peers are asked instead)."""
    name, origin = manifest.data.tokenizer, manifest.origin
    try:
        if is_url(name) or is_url(origin):
            url = name if is_url(name) else urllib.parse.urljoin(origin, name) if confined(name) else ""
            if not is_url(url):
                return None
            body = _fetch(url)
            where = url
        else:
            if not origin and not confined(name):  # a manifest handed out by a peer: only names in this folder
                return None
            path = (Path(origin) if origin else Path.cwd()) / Path(name).expanduser()
            if not path.is_file():
                return None
            body, where = path.read_bytes(), str(path)
        check_hash(body, manifest.data.tokenizer_sha256, f"the tokenizer at {where}")
        return body
    except (TokenizerError, OSError) as e:
        logger.warning(f"{e}; asking the swarm's peers instead")
        return None


def _fetch(url: str) -> bytes:
    try:
        return http_get(url, URL_TIMEOUT, MAX_TOKENIZER_BYTES)
    except TooLargeError:
        raise TokenizerError(
            f"{url} sent more than {MAX_TOKENIZER_BYTES} bytes; that is not a tokenizer.json"
        ) from None
    except Exception as e:  # HTTP errors, timeouts (the whole body's too), refused connections, bad URLs
        raise TokenizerError(f"could not get the tokenizer from {url}: {str(e)[:200]}") from None
