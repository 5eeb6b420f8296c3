"""What a peer's trainer reads, opened: the swarm's data located, its index fetched and pinned, a fetcher ready.

Three cases:
- the manifest pins a prepared folder (`data.index_sha256`): its index comes from the cache, from `data.source`
  and `data.mirrors` (a folder, an http(s) or fsspec URL; relative to where the manifest came from), or from the
  swarm's peers, and must hash to the pin; its chunks come the same way, each verified (fetching.py);
- the manifest names a raw source ("stdlib", text files on this machine): it is prepared once into the local cache
  with the swarm's tokenizer (corpus.ensure_prepared), and read in place;
- the peer's own data (swarm-peer --data): a prepared folder or a raw source on this machine, unpinned.
Either way the data must be tokenized with the swarm's tokenizer and fit the model's vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path

from swarm.dataset.cache import ChunkCache
from swarm.dataset.corpus import ensure_prepared
from swarm.dataset.documents import STDLIB
from swarm.dataset.fetching import ChunkFetcher, PeerSource, fetch_index
from swarm.dataset.index import check_fits
from swarm.dataset.locations import FolderLocation, Location, location_of
from swarm.dataset.shards import TokenShards, prepared_index
from swarm.dataset.tokenizer import Tokenizer
from swarm.errors import DataError
from swarm.manifests.manifest import Manifest

logger = logging.getLogger(__name__)


def data_locations(manifest: Manifest) -> list[Location]:
    """Where the manifest's prepared data is published, in the order to try: the source, then its mirrors."""
    return [location_of(name, manifest.origin) for name in (manifest.data.source, *manifest.data.mirrors)]


async def open_data(
    manifest: Manifest,
    tokenizer: Tokenizer | None,
    cache: ChunkCache,
    peers: PeerSource | None = None,
    own_source: str | None = None,
) -> ChunkFetcher:
    """A fetcher of the data this peer's trainer reads (see the module's docstring). DataError says what is
    wrong and what to do; the cache's cap is checked against the data's chunks."""
    config = manifest.data
    if own_source is None and config.index_sha256:
        locations = data_locations(manifest)
        index = await fetch_index(locations, config.index_sha256, cache, peers)
    else:
        source = own_source if own_source is not None else config.source
        index_path = prepared_index(source)
        if index_path is None:
            if source != STDLIB and not Path(source).expanduser().exists():
                raise DataError(
                    f"data source {source!r} is neither 'stdlib', a file nor a folder on this machine: check the path"
                )
            if tokenizer is None:
                raise DataError(f"data source {source!r} is raw text, and this peer has no tokenizer to tokenize it")
            index_path = ensure_prepared(source, tokenizer, None, config.shards, config.heldout_fraction)
        index = TokenShards.open(index_path).index
        locations = [FolderLocation(index_path.parent)]
    check_fits(index, manifest, tokenizer, locations[0].name)
    cache.check_cap(max((chunk.size for chunk in index.chunks), default=0))
    return ChunkFetcher(index, locations, cache, peers)
