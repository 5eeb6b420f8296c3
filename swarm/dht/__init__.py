"""The DHT: starting a node with clear errors, joining a swarm through what --join names, the keys and records
peers keep there (announcements, trainer reports), and the peer's cached view of them."""
