"""generation: see docs/ARCHITECTURE.md."""
