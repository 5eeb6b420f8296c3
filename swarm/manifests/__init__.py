"""The manifest that defines a swarm (swarm-init's other part, what it reads from files, is dataset/new_swarm.py).

- manifest.py: the Manifest data model (each setting's default stated once), its canonical JSON and swarm id.
- validation.py: the rules: a decoded document becomes a Manifest, or a ManifestError naming the field.
- fields.py: the typed field readers validation is written with, and the check of peers' multiaddrs.
- loading.py: reading a manifest from a path or an http(s) URL (with its secret file), and writing one.
- presets.py: model size presets and a new swarm's settings (swarm-init), and the tests' small swarm.
"""
