"""The manifest that defines a swarm: its data model and validation, loading it from a path or URL, presets, and
what a new swarm's manifest takes from files (swarm-init's library)."""
