"""Engram conditional memory (docs/design.md §7): host-side tokenizer compression and n-gram hashing,
device-side sharded table lookup and gated injection. The NNX module is `dsv41_jax.layers.engram`.
"""
