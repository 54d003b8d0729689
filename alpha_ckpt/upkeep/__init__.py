"""upkeep: see docs/ARCHITECTURE.md."""
