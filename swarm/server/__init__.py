"""What serves a stage: see docs/ARCHITECTURE.md, "Layout"."""
