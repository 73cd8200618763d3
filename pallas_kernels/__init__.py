"""The hot paths as ops, their Pallas kernels, and the one dispatcher between them (docs/design.md §T5).

Three layers, imported in one direction (tests/test_import_graph.py checks it):

  `pallas_kernels.ops`       the bottom of the house: each hot path's pure math as one op (arrays in,
                             arrays out, no parameters, no config), importing only jax, numpy and the
                             standard library. The model, the optimizer, decode and the kernels'
                             backward passes all call these.
  kernels (this package's    each computes one op faster on some backend and shapes, with the op's
  modules)                   signature; they import the ops, never the model or the launcher.
  `pallas_kernels.dispatch`  the registry of ops and kernels and `call(name, *arrays, policy=...)`:
                             the one place that picks reference or kernel ("auto" | "reference" |
                             "kernel", `ModelConfig.ops`) and runs a kernel per batch shard.

This module imports nothing, so `import pallas_kernels.ops.…` loads only the op.
"""
