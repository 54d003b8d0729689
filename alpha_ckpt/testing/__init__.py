"""Test support shipped with the package, above every layer of the product: nothing in the product imports it.

- :mod:`.forge`: deliberately altered generations (``python -m alpha_ckpt.testing.forge``).
- :mod:`.faults`: the hooks that kill a process at a named point or make a tree role misbehave,
  and the environment variables that install them in a process alpha-run starts.
- :mod:`.simulate`: the tree publication at any size in one process.
- :mod:`.oracle`: the built-in learner in one process, the reference every distributed run must match
  (``python -m alpha_ckpt.testing.oracle``).
- :mod:`.launch`: how tests and gates start alpha-run, alpha-ckpt, torchrun and gloo ranks, each the cheapest
  way that still proves the point (above the launcher it starts: the layer of the processes' entry points).
"""
