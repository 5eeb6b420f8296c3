"""Training data, from a source to the batches a trainer reads.

- documents.py: the documents of a source ("stdlib", text files, .jsonl lines, parquet rows) and which are held out.
- corpus.py: tokenizing a corpus once into memory-mapped token shards and their index (swarm-data prepare, the cache).
- shards.py: reading prepared shards (TokenShards), each trainer's order (TrainingStream), held-out batches.
- tokenizer.py: the byte vocabulary or a Hugging Face tokenizer.json (loaded, or a byte-level BPE trained here).
- tokenizer_source.py: where a peer finds its swarm's tokenizer (its cache, next to the manifest, its URL); asking the
  peers for it is swarm/client/rpc.py's (tokenizer_from_peers).
"""
