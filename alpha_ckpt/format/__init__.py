"""format: see docs/ARCHITECTURE.md."""
