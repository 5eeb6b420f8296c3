"""Training data: documents of a source, corpora tokenized into memory-mapped token shards, tokenizers and where
a peer gets its swarm's tokenizer."""
