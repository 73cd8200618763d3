"""Session 57's two candidates, kept off main until `next_s58_candidates.sh` times them: the text
edits that turn a copy of the repository into the candidate tree.

  python3 benchmarks/gpu_runs/calls/s57_candidate.py DIR     (DIR: a copy of the repository)

- pallas_kernels/mhc.py: hc_site's X' behind an optimization barrier (the same values).
- dsv41_jax/layers/rope.py: RoPE as one elementwise pass over the width, no concatenation (the
  same arithmetic op by op); tests/dsv41_jax/layers/test_rope.py gains its equality test.

Each edit replaces text that must occur exactly once (or, with `old` None, appends); a copy that no
longer matches stops with the file's name, so a stale candidate cannot apply half.
"""

import os
import sys

EDITS = [
    ('pallas_kernels/mhc.py',
     '''  X_new = expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, F_BxTxD)
''',
     '''  # X' leaves as bfloat16 (the streams' dtype), and the collapse, the mix and, in the backward,
  # the next expand's column sums all read that. Without the barrier XLA kept expand's float32
  # sum as well, to fuse into each reader: on the H100 37 f32 [4, 4096, 4, 1024] buffers a
  # micro-batch at s3 (6.3 ms of writes, each read again by two or three fusions;
  # benchmarks/gpu_runs/2026-12-06/s57_prof, `loop_add_fusion` at this function's expand).
  X_new = jax.lax.optimization_barrier(expand(X_BxTxNxD, post_BxTxN, comb_BxTxNxN, F_BxTxD))
'''),
    ('dsv41_jax/layers/rope.py',
     '''  (used to de-rotate the attention output, docs/design.md §4.4). Math in float32, result in x's dtype.
  """
  r = 2 * len(inv_freq)
  pos = positions.astype(jnp.float32)
  while pos.ndim < x.ndim - 1:
    pos = pos[..., None]
  angle = pos[..., None] * jnp.asarray(inv_freq, jnp.float32)          # [..., r/2]
  if inverse:
    angle = -angle
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  rot = x[..., -r:].astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
  a, b = rot[..., 0], rot[..., 1]
  out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], r)
  return jnp.concatenate([x[..., :-r], out.astype(x.dtype)], axis=-1)
''',
     '''  (used to de-rotate the attention output, docs/design.md §4.4). Math in float32, result in x's dtype.

  Written over the whole width as x·cos + swap(x)·sin, swap exchanging the channels of each pair
  and sin carrying the pair's sign (−sin on its first channel), with the channels before the
  rotated ones passed through by a select: one elementwise pass over x, forward and backward,
  where slicing off the rotated part and concatenating it back took two (a concatenation as the
  fusion's root: 3.3 ms of s3's micro-batch on the H100, benchmarks/gpu_runs/2026-12-06/s57_prof).
  The same values bit for bit: a·cos + b·(−sin) is a·cos − b·sin and b·cos + a·sin is a·sin + b·cos
  in IEEE arithmetic, op by op (tests/dsv41_jax/layers/test_rope.py); compiled, XLA may contract
  a product and a sum into one FMA in either form, so float32 results can differ by an ulp before
  the cast.
  """
  r = 2 * len(inv_freq)
  c = x.shape[-1]
  pos = positions.astype(jnp.float32)
  while pos.ndim < x.ndim - 1:
    pos = pos[..., None]
  angle = pos[..., None] * jnp.asarray(inv_freq, jnp.float32)          # [..., r/2]
  if inverse:
    angle = -angle
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  if c % 2:   # the pairs (2i, 2i + 1) of the rotated channels are not the pairs of the width
    rot = x[..., -r:].astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
    a, b = rot[..., 0], rot[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], r)
    return jnp.concatenate([x[..., :-r], out.astype(x.dtype)], axis=-1)
  # Full-width tables [..., C] (small: no head axis): 1 and 0 before the rotated channels.
  lead = angle.shape[:-1]
  cos_c = jnp.concatenate([jnp.ones(lead + (c - r,), jnp.float32),
                           jnp.repeat(cos, 2, axis=-1)], axis=-1)
  sin_c = jnp.concatenate([jnp.zeros(lead + (c - r,), jnp.float32),
                           jnp.stack([-sin, sin], axis=-1).reshape(*lead, r)], axis=-1)
  xf = x.astype(jnp.float32)
  swapped = xf.reshape(*x.shape[:-1], c // 2, 2)[..., ::-1].reshape(x.shape)
  rotated = np.arange(c) >= c - r                                       # [C] constant
  return jnp.where(rotated, xf * cos_c + swapped * sin_c, xf).astype(x.dtype)
'''),
    ('tests/dsv41_jax/layers/test_rope.py',
     None,
     '''

def _concat_form(x, positions, inv_freq, inverse=False):
  """The slice-and-concatenate form apply_rope had until session 57 (the same arithmetic)."""
  r = 2 * len(inv_freq)
  pos = positions.astype(jnp.float32)
  while pos.ndim < x.ndim - 1:
    pos = pos[..., None]
  angle = pos[..., None] * jnp.asarray(inv_freq, jnp.float32)
  angle = -angle if inverse else angle
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  rot = x[..., -r:].astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
  a, b = rot[..., 0], rot[..., 1]
  out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], r)
  return jnp.concatenate([x[..., :-r], out.astype(x.dtype)], axis=-1)


def test_full_width_form_equals_the_concatenation_bit_for_bit():
  # The select-and-swap form (one elementwise pass) against the form it replaced: values and
  # gradients bit for bit, with a head axis and without, bfloat16 and float32, both directions,
  # ±0.0 and large values among the passed-through channels; all channels rotated too.
  import jax
  rng = np.random.default_rng(7)
  for shape, r, dtype, inverse in [((2, 9, 3, 16), 8, jnp.bfloat16, False),
                                   ((2, 9, 3, 16), 8, jnp.float32, True),
                                   ((3, 11, 12), 4, jnp.bfloat16, True),
                                   ((3, 11, 12), 12, jnp.float32, False)]:
    x = rng.standard_normal(shape).astype(np.float32) * 3
    x[..., 0] = -0.0
    x[..., 1] = 1e30
    x = jnp.asarray(x).astype(dtype)
    pos = jnp.asarray(rng.integers(0, 70000, size=shape[:2]))
    inv = rope.rope_inv_freq(r, 160000.0)
    got = rope.apply_rope(x, pos, inv, inverse=inverse)
    want = _concat_form(x, pos, inv, inverse)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)).view(np.uint32),
                                  np.asarray(want.astype(jnp.float32)).view(np.uint32))
    g = jnp.asarray(rng.standard_normal(shape), dtype)
    vjp = lambda f: jax.vjp(lambda v: f(v, pos, inv, inverse=inverse) if f is rope.apply_rope
                            else f(v, pos, inv, inverse), x)[1](g)[0]
    np.testing.assert_array_equal(np.asarray(vjp(rope.apply_rope).astype(jnp.float32)),
                                  np.asarray(vjp(_concat_form).astype(jnp.float32)))
'''),
]


def main(root: str) -> int:
  texts = {}
  for path, old, new in EDITS:
    text = texts.get(path) or open(os.path.join(root, path)).read()
    if old is None:
      text += new
    elif text.count(old) != 1:
      print(f"s57_candidate: {path}: the text to replace occurs {text.count(old)} times, not once")
      return 1
    else:
      text = text.replace(old, new)
    texts[path] = text
  for path, text in texts.items():
    with open(os.path.join(root, path), "w") as f:
      f.write(text)
    print(f"s57_candidate: edited {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
