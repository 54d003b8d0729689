"""The benchmark behind ``scripts/bench_store.py``, one module per section (store, stall, owners,
checkpointer and sharded, many-tensors), their shared helpers and the command line."""
