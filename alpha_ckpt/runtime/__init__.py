"""runtime: see docs/ARCHITECTURE.md."""
