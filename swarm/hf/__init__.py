"""Hugging Face: the format of a model (config.json, tensor names), writing an exported model as a folder that
transformers loads, and starting a swarm from a pretrained Llama."""
