"""Training data, from a source to the batches a trainer reads, wherever the swarm's data is published.

- documents.py, remote_documents.py: the documents of a source (text files, .jsonl lines, parquet rows) on this
  machine or at URLs (streamed), and which are held out.
- corpus.py: tokenizing a corpus once into fixed-size token chunks and their index (swarm-data prepare, the cache).
- index.py: a prepared corpus's index, read and checked (its hash is the data's name in the manifest).
- locations.py: where a prepared folder is published (a folder, http(s), fsspec URLs) and downloading from there.
- cache.py: this machine's capped cache of verified chunks (least recently used go first).
- sharing.py: peers handing chunks (and the index) to each other over the swarm's RPC.
- fetching.py: a chunk onto this machine, verified: cache, locations, then peers.
- reading_order.py, progress.py: which chunk a trainer reads next so the swarm reads its corpus once an epoch;
  the trainers' progress records in the DHT and a trainer's place on its own disk.
- stream.py: what a trainer reads (ChunkStream); opening.py: the swarm's data opened for a peer.
- shards.py: a prepared folder read whole from this machine (TokenShards; benchmarks and tools), held-out batches.
- new_swarm.py: what a new swarm's manifest takes from files (a tokenizer, prepared data, a pretrained model).
- tokenizer.py, tokenizer_source.py: the byte vocabulary or a tokenizer.json, and where a peer finds the swarm's.
"""
