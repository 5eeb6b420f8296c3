"""The contract between peers, used by both sides: stage RPC messages and their validation, tensor codecs."""
