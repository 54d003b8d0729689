"""The memory tier: generations held in host memory by every rank and replicated to peer ranks."""
