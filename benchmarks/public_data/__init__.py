"""The public data benchmark (`python -m benchmarks.public_data`): a corpus published by a local HTTP server, each
trainer behind its own emulated home link, against the same swarm reading a local copy. Its parts:

- __main__.py: the entry: the corpus, the web server, the real swarm's runs, the JSON line
- readers.py: trainers' data layers alone reading one epoch of the published corpus
"""
