"""The benchmark tool: ``python -m bench SUITE [options]`` runs one suite by name (``python -m bench``
lists them). Every suite measures ours against a baseline in the same run and ends with one JSON
record that names the code and the machine (:mod:`bench.record`)."""
