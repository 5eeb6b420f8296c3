"""What calls stages: the RPC client calls and the trainer; see docs/ARCHITECTURE.md, "Layout"."""
