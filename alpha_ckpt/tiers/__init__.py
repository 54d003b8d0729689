"""tiers: see docs/ARCHITECTURE.md."""
