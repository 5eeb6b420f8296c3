"""Hugging Face, both ways.

- format.py: Hugging Face's format of a model: config.json and tensor names, and the way back (pure).
- folder.py: writing an exported model as a folder that transformers loads (swarm-export --format hf).
- pretrained.py: starting a swarm from a pretrained Llama: reading its folder, pinning its weights, loading a stage.
"""
