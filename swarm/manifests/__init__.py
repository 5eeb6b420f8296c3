"""The manifest that defines a swarm, and swarm-init's library.

- manifest.py: the Manifest data model (each setting's default stated once), its canonical JSON and swarm id.
- validation.py: the rules: a decoded document becomes a Manifest, or a ManifestError naming the field.
- fields.py: the typed field readers validation is written with, and the check of peers' multiaddrs.
- loading.py: reading a manifest from a path or an http(s) URL (with its secret file), and writing one.
- presets.py: model size presets and a new swarm's settings (swarm-init), and the tests' small swarm.
- new_swarm.py: what a new swarm's manifest takes from files (a tokenizer, prepared data, a pretrained model).
"""
