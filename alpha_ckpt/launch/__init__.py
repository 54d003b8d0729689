"""launch: see docs/ARCHITECTURE.md."""
