"""Where a peer sits in the internet, and internet links on one machine.

- coordinates.py: Vivaldi network coordinates: the round trip between two peers that never talked (pure).
- startup_cache.py: answers of start-up checks (reachability, identity) that a restart on this machine reuses.
- http_get.py: an HTTP GET with a deadline for its whole body (a manifest or a tokenizer by URL).
- liveness.py: whether a peer that owes this one a reply is still there (a vanished peer costs seconds).
"""
