"""Muon for the matrix group, vanilla and head-wise (docs/design.md §T2).

Per parameter: `m ← β m + g` (one buffer), Nesterov direction `d = g + β m`, orthogonalized by
Newton–Schulz (8 steps of (3.4445, −4.7750, 2.0315), then 2 of (2, −1.5, 0.5), which bring every
singular value to 1 within ~5e-4), then rescaled so the update RMS is `update_rms` (0.18): an m×n
matrix with unit singular values has RMS 1/√max(m, n).

Schedule (`ns_schedule`, `NS_SCHEDULES`): "spec" is the 8 + 2 schedule above; "polar_express" is
the per-step quintics of Amsel, Persson, Musco & Gower 2025, "The Polar Express: Optimal Matrix
Sign Methods and Their Application to the Muon Algorithm" (arXiv 2505.16932), as published in the
authors' reference code (github.com/NoahAmsel/PolarExpress, `polar_express/basic.py`): eight
polynomials computed for σ_min/σ_max = 1e-3, each but the last divided by the safety factor 1.01
(a/1.01, b/1.01³, c/1.01⁵), the last (15/8, −10/8, 3/8) unchanged, and the input divided by
1.01·‖X‖_F instead of ‖X‖_F. Eight steps instead of ten (24 products per matrix against 30). It
lands every normalized singular value ≥ 1e-3 on 1 (exact arithmetic) but leaves smaller ones short
(σ/‖X‖_F = 1e-4 → 0.57, against 1.00 for "spec"): benchmarks/RESULTS.md "Polar Express".

Axes are counted from the END, so leading scan-stacked layer axes and expert / group axes are batch
axes: a vanilla weight orthogonalizes its last two axes `(in, out)`; a head-wise weight
`(..., in, heads, head_dim)` orthogonalizes each `(in, head_dim)` head on its own.

Batched: every matrix of every Muon parameter is one item of a batch. Items of the same (rows,
cols) are concatenated and go through ONE Newton–Schulz call whose iterations are a
`lax.fori_loop` over the coefficient table (two steps per iteration, so that no copy of the iterate
is written per step: `_UNROLL`), so the compiled update holds one Newton–Schulz body per distinct
matrix shape, however many parameters share it: each step is three batched products
over all its items, on the short side of the matrices (a tall batch iterates on XᵀX, so no
transposed copy of a matrix is written on the way in or out).

Precision (`ns_dtype`): "float32" runs the products in float32 at HIGHEST precision with a float32
iterate; "bfloat16" keeps the iterate X and the Gram matrices in bfloat16 between products, every
product accumulating in float32 and each polynomial combined in float32 before its rounding to
bfloat16 (so no product is preceded by a separate cast pass); before the last step each step is
X ← PX, one bfloat16 product with P the step's polynomial in the Gram matrix (no elementwise pass
over the m×n iterate), and the last step is written in float32 (`_iterate`). That is the
tensor-core path of accelerators: singular values within 1 ± 5e-3 of one and the update RMS
within 1 % of 0.18 on real gradients (`benchmarks/muon_precision.py`). The two are
the reference and the kernel of the dispatcher's op `newton_schulz` (`pallas_kernels.dispatch`,
registered below), so `ns_dtype` may also be an op policy (`OptimConfig.newton_schulz`): "auto"
takes bfloat16 off the CPU (unchanged from before the policy; its speed against float32 is not
measured) and float32 on the CPU, "reference" float32, "kernel" bfloat16.

On a mesh. Parameters are split over devices on their matrix axes too (the model width over
`fsdp`, heads and MLP width over `tensor`), and XLA's partitioner formed a concatenated batch of
such matrices only by replicating it ("Involuntary full rematerialization"), after which every
device ran the products of nearly every matrix: the optimizer's largest cost did not shrink with
the device count. So when the chain knows its parameters' layouts (`specs`) and a mesh is in
context (`jax.set_mesh`), each parameter is orthogonalized on its own, in its own shape, after one
all-to-all that moves the mesh axes off its matrix axes onto its item axes (layers, experts, heads)
and spreads it over the mesh axes it does not use (`item_split_plan`, inside `shard_map`); each
device then iterates whole matrices, its share of the items, with no collective in the loop, and
the result moves back. A matrix axis whose mesh axes no item axis can take evenly is gathered
whole instead (those devices then iterate the same matrices). Without a mesh the batches are as
above.

Frozen parameters (`frozen(path)`, the chain's frozen set, e.g. the ViT until the decay) get zero
gradients and so a zero direction while frozen: their matrices are batched apart from the others,
and each such batch runs Newton–Schulz only when some entry is non-zero (`lax.cond`), so a frozen
ViT costs no matrix products. Newton–Schulz maps zero to zero, so the result is the same either way.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from optim import table as table_lib
from pallas_kernels import dispatch

NS_COEFFS: tuple[tuple[float, float, float], ...] = (
    ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2)
NS_DTYPES = ("float32", "bfloat16")

# The Polar Express quintics as published (module docstring), before the safety factor.
_POLAR_EXPRESS_QUINTICS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_PE_SAFETY = 1.01
PE_COEFFS: tuple[tuple[float, float, float], ...] = tuple(
    (a / _PE_SAFETY, b / _PE_SAFETY ** 3, c / _PE_SAFETY ** 5)
    for a, b, c in _POLAR_EXPRESS_QUINTICS[:-1]) + _POLAR_EXPRESS_QUINTICS[-1:]


class Schedule(NamedTuple):
  """A Newton–Schulz schedule: the (a, b, c) of each step, and `margin`: the input is divided by
  margin·‖X‖_F."""
  coeffs: tuple[tuple[float, float, float], ...]
  margin: float


NS_SCHEDULES = {"spec": Schedule(NS_COEFFS, 1.0),
                "polar_express": Schedule(PE_COEFFS, _PE_SAFETY)}


def schedule(name: str) -> Schedule:
  """The schedule `name` of NS_SCHEDULES (ValueError naming the known ones otherwise)."""
  if name not in NS_SCHEDULES:
    raise ValueError(f"ns_schedule {name!r} is not one of {', '.join(NS_SCHEDULES)}")
  return NS_SCHEDULES[name]

_HI = jax.lax.Precision.HIGHEST

# Two Newton–Schulz steps per loop iteration. A step's last product writes the new iterate while
# reading the old one, and a GEMM (cuBLAS) cannot write over its own operand, so with one step per
# iteration XLA copies the product back into the loop's carry buffer every step: on the GPU that
# was a full read and write of every iterate per step (m3: 103 GB, ~25 ms per optimizer update,
# benchmarks/RESULTS.md). With two, the second product can take the buffer of the first's
# operand, dead by then. The steps and their order are unchanged (bitwise the same result).
_UNROLL = 2


def _iterator(ns_dtype: str):
  """(precision, iterate function) for a precision of NS_DTYPES or a policy of the op
  `newton_schulz` (resolved by the dispatcher at trace time; PolicyError for anything else)."""
  policy = {"float32": "reference", "bfloat16": "kernel"}.get(ns_dtype, ns_dtype)
  impl, iterate = dispatch.choose("newton_schulz", policy)
  return ("float32" if impl == _NEWTON_SCHULZ.reference else "bfloat16"), iterate


def resolve_ns_dtype(ns_dtype: str) -> str:
  """The precision ("float32" | "bfloat16") that `ns_dtype` (a precision or a policy) runs."""
  return _iterator(ns_dtype)[0]


def _normalized(x: jax.Array, margin: float = 1.0) -> jax.Array:
  """Each matrix divided by `margin` × its Frobenius norm (every singular value ≤ 1 / margin), in
  float32."""
  x = x.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
  if margin != 1.0:
    norm = norm * margin
  return x / jnp.maximum(norm, 1e-30)


def _short_side(tall: bool):
  """(Gram, apply) equations on the short side of [..., m, n] matrices: for m ≤ n, A = XXᵀ (m×m)
  and BX; for tall ones, A = XᵀX (n×n) and XB, the same map of singular values, and no
  transpose of X is ever written (the products take their operands in either orientation)."""
  if tall:
    return "...km,...kn->...mn", lambda mm, b, x, *out: mm("...mk,...kn->...mn", x, b, *out)
  return "...mn,...kn->...mk", lambda mm, b, x, *out: mm("...mk,...kn->...mn", b, x, *out)


def _iterate(x_BxMxN: jax.Array, coeffs, ns_dtype: str) -> jax.Array:
  """The Newton–Schulz steps on normalized matrices (already in the iterate's dtype), on their
  short side (`_short_side`); float32 out. Each step maps X ← aX + (bA + cA²)X with A = XXᵀ
  (for m ≤ n), i.e. each singular value s ← as + bs³ + cs⁵."""
  table = jnp.asarray(np.asarray(coeffs, np.float32))
  gram, apply = _short_side(x_BxMxN.shape[-2] > x_BxMxN.shape[-1])
  if ns_dtype == "float32":
    mm = lambda eq, u, v: jnp.einsum(eq, u, v, precision=_HI)

    def step(i, x):
      a, b, c = table[i, 0], table[i, 1], table[i, 2]
      a_MxM = mm(gram, x, x)
      b_MxM = b * a_MxM + c * mm("...mk,...kl->...ml", a_MxM, a_MxM)
      return a * x + apply(mm, b_MxM, x)

    return jax.lax.fori_loop(0, len(coeffs), step, x_BxMxN, unroll=_UNROLL)

  # bfloat16: the Gram matrix is taken about the identity, A = I + Aₛ, so that what is rounded to
  # bfloat16 is small once X is near orthogonal (A ≈ I; rounding A itself would move the singular
  # values by up to 4e-3). Every product accumulates in float32; XXᵀ stays float32 until I is
  # taken off.
  #   The loop's steps write X ← PX in one product, P = (a + b + c)·I + (b + 2c)·Aₛ + c·Aₛ²
  # combined in float32 and rounded to bfloat16 once, and Aₛ² and PX written in bfloat16: no
  # elementwise pass over the m×n iterate. These steps only carry the singular values into the
  # last step's basin (their rounding of P is that of X itself, 2⁻⁹ relative).
  #   The last step, which lands the singular values (its polynomial has zero slope at 1, so the
  # earlier roundings are squared away), is written about the identity in float32:
  # X ← (a + b + c)·X + BX, B = (b + 2c)·Aₛ + c·Aₛ², the products Aₛ² and BX in float32.
  bf16, f32 = jnp.bfloat16, jnp.float32
  mm = lambda eq, u, v, out: jnp.einsum(eq, u, v, preferred_element_type=out)
  eye = jnp.eye(min(x_BxMxN.shape[-2:]), dtype=f32)
  a_s = lambda x: (mm(gram, x, x, f32) - eye).astype(bf16)
  square = lambda y, out: mm("...mk,...kl->...ml", y, y, out).astype(f32)

  def step(i, x):
    a, b, c = table[i, 0], table[i, 1], table[i, 2]
    as_MxM = a_s(x)
    p_MxM = ((a + b + c) * eye + (b + 2 * c) * as_MxM.astype(f32) + c * square(as_MxM, bf16)
             ).astype(bf16)
    return apply(mm, p_MxM, x, bf16)

  x = jax.lax.fori_loop(0, len(coeffs) - 1, step, x_BxMxN, unroll=_UNROLL)
  a, b, c = coeffs[-1]
  as_MxM = a_s(x)
  b_MxM = ((b + 2 * c) * as_MxM.astype(f32) + c * square(as_MxM, f32)).astype(bf16)
  return (a + b + c) * x.astype(f32) + apply(mm, b_MxM, x, f32)


def _iterate_dtype(ns_dtype: str):
  return jnp.float32 if ns_dtype == "float32" else jnp.bfloat16


def iterate_float32(x_BxMxN: jax.Array, coeffs=NS_COEFFS) -> jax.Array:
  """The op `newton_schulz`'s reference: the steps in float32 at HIGHEST precision."""
  return _iterate(x_BxMxN.astype(jnp.float32), coeffs, "float32")


def iterate_bfloat16(x_BxMxN: jax.Array, coeffs=NS_COEFFS) -> jax.Array:
  """The op's fast form: the bfloat16 iterate with float32 accumulation (module docstring)."""
  return _iterate(x_BxMxN.astype(jnp.bfloat16), coeffs, "bfloat16")


def _off_cpu(args, kwargs) -> str | None:
  if dispatch.backend() != "cpu":
    return None
  return "float32 on the CPU (no bfloat16 matrix units)"


_NEWTON_SCHULZ = dispatch.Op(
    "optim.muon:iterate_float32",
    (dispatch.Kernel("optim.muon:iterate_bfloat16", unsupported=lambda args, kwargs: None,
                     faster=_off_cpu),),
    owner="optim")
dispatch.register("newton_schulz", _NEWTON_SCHULZ)


def newton_schulz(x_BxMxN: jax.Array, ns_dtype: str = "float32", ns_schedule: str = "spec"
                  ) -> jax.Array:
  """Approximate U Vᵀ of each matrix in the batch (float32 out; precision `ns_dtype`, schedule
  `ns_schedule`, module docstring). The matrix is normalized by (the schedule's margin ×) its
  Frobenius norm, then iterated on its short side (A is min(m, n)²)."""
  ns_dtype, iterate = _iterator(ns_dtype)
  sched = schedule(ns_schedule)
  return iterate(_normalized(x_BxMxN, sched.margin).astype(_iterate_dtype(ns_dtype)), sched.coeffs)


def _as_matrices(g: jax.Array, headwise: bool) -> jax.Array:
  """[items, rows, cols] view of a parameter's matrices (heads moved next to the batch axes)."""
  x = jnp.moveaxis(g, -2, -3) if headwise else g       # (..., in, heads, hd) -> (..., heads, in, hd)
  return x.reshape(-1, *x.shape[-2:])


def _from_matrices(x: jax.Array, like: jax.Array, headwise: bool) -> jax.Array:
  if headwise:
    *lead, i, h, d = like.shape
    return jnp.moveaxis(x.reshape(*lead, h, i, d), -3, -2)
  return x.reshape(like.shape)


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


class Move(NamedTuple):
  """One step of `item_split_plan`: mesh axis `axis` leaves array axis `source` (None: the
  parameter is replicated over it) for array axis `target`, where it becomes the innermost
  (None: gathered, so the devices along it hold the same whole matrices)."""
  axis: str
  source: int | None
  target: int | None


def item_split_plan(shape: Sequence[int], spec: PartitionSpec, mesh_sizes: Mapping[str, int],
                    headwise: bool) -> tuple[list[Move], PartitionSpec]:
  """How a parameter of `shape`, laid out as `spec`, is laid out for Newton–Schulz on a mesh of
  `mesh_sizes` (module docstring): each matrix axis made whole, its mesh axes (innermost first)
  moved onto item axes, then every mesh axis the parameter does not use spread over item axes;
  each onto the item axis with the most entries per device that it divides. A matrix axis whose
  mesh axes cannot all move is gathered whole instead (its devices then iterate the same
  matrices). Returns the moves in order and the resulting layout."""
  ndim = len(shape)
  matrix = (ndim - 3, ndim - 1) if headwise else (ndim - 2, ndim - 1)
  size = lambda a: int(mesh_sizes.get(a, 1))
  entries = [[a for a in _axes(e) if size(a) > 1] for e in (*spec, *[None] * (ndim - len(spec)))]
  local = [n // int(np.prod([size(a) for a in e])) for n, e in zip(shape, entries)]
  items = [i for i in range(ndim) if i not in matrix]
  moves: list[Move] = []

  def place(axes, source) -> bool:
    trial, planned = list(local), []
    for a in axes:
      fits = [i for i in items if trial[i] % size(a) == 0]
      if not fits:
        return False
      i = max(fits, key=lambda i: trial[i])
      trial[i] //= size(a)
      planned.append(Move(a, source, i))
    local[:] = trial
    moves.extend(planned)
    for mv in planned:
      entries[mv.target].append(mv.axis)
    return True

  for m in matrix:
    axes = entries[m][::-1]
    if not place(axes, m):
      moves.extend(Move(a, m, None) for a in axes)
    entries[m] = []
  used = {a for e in entries for a in e}
  for a in mesh_sizes:
    if size(a) > 1 and a not in used:
      place([a], None)
  return moves, PartitionSpec(*(None if not e else (e[0] if len(e) == 1 else tuple(e))
                                for e in entries))


def _to_items(x: jax.Array, moves: Sequence[Move]) -> jax.Array:
  """Inside `shard_map`: a device's block in the parameter's layout -> its block in the plan's."""
  for a, source, target in moves:
    if source is None:
      x = _own_slice(x, a, target)
    elif target is None:
      x = jax.lax.all_gather(x, a, axis=source, tiled=True)
    else:
      x = jax.lax.all_to_all(x, a, split_axis=target, concat_axis=source, tiled=True)
  return x


def _own_slice(x: jax.Array, axis_name: str, axis: int) -> jax.Array:
  """This device's block of `axis`, split over the mesh axis `axis_name`."""
  n = x.shape[axis] // jax.lax.axis_size(axis_name)
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * n, n, axis)


def _from_items(x: jax.Array, moves: Sequence[Move]) -> jax.Array:
  """The inverse of `_to_items`."""
  for a, source, target in reversed(moves):
    if source is None:
      x = jax.lax.all_gather(x, a, axis=target, tiled=True)
    elif target is None:
      x = _own_slice(x, a, source)
    else:
      x = jax.lax.all_to_all(x, a, split_axis=source, concat_axis=target, tiled=True)
  return x


def _orthogonalize_in_place(g: jax.Array, headwise: bool, ns_dtype: str, frozen: bool,
                            ns_schedule: str) -> jax.Array:
  """`orthogonalize` of one parameter in its own shape (leading axes as batch axes, a head-wise
  weight's heads moved first), no reshape or concatenation: on a mesh, its layout is kept."""
  ns_dtype, iterate = _iterator(ns_dtype)
  sched = schedule(ns_schedule)
  x = jnp.moveaxis(g, -2, 0) if headwise else g
  x = _normalized(x, sched.margin).astype(_iterate_dtype(ns_dtype))
  x = _run_chain(x, iterate, sched.coeffs, frozen)
  return jnp.moveaxis(x, 0, -2) if headwise else x


def _run_chain(x: jax.Array, iterate, coeffs, skippable: bool) -> jax.Array:
  """The iterate on normalized matrices; a `skippable` (frozen) batch only while some entry is
  non-zero (zero maps to zero either way)."""
  run = lambda x: iterate(x, coeffs)
  if skippable:
    return jax.lax.cond(jnp.any(x != 0), run, lambda x: jnp.zeros(x.shape, jnp.float32), x)
  return run(x)


def orthogonalize_many(gs: Sequence[jax.Array], headwise: Sequence[bool],
                       ns_dtype: str = "float32", frozen: Sequence[bool] | None = None,
                       ns_schedule: str = "spec",
                       specs: Sequence[PartitionSpec | None] | None = None) -> list[jax.Array]:
  """`orthogonalize` of every array, with one batched Newton–Schulz per distinct matrix shape
  (and per frozen-or-not: a batch of `frozen` arrays is skipped while all of it is zero). With
  `specs` (each array's layout) and a mesh of more than one device in context, each array is
  orthogonalized on its own, on whole matrices split by items (`item_split_plan`; module
  docstring)."""
  frozen = [False] * len(gs) if frozen is None else list(frozen)
  mesh = jax.sharding.get_abstract_mesh()
  if (specs is not None and any(s is not None for s in specs) and mesh is not None
      and not mesh.empty and mesh.size > 1):
    sizes = dict(mesh.shape)
    out = []
    for g, h, f, spec in zip(gs, headwise, frozen, specs):
      one = lambda x: _orthogonalize_in_place(x, h, ns_dtype, f, ns_schedule)
      if spec is None:
        out.append(one(g))
        continue
      moves, _ = item_split_plan(g.shape, spec, sizes, h)
      # Traced here, in this iteration, so the closures see this parameter's h, f and moves.
      out.append(jax.shard_map(lambda x: _from_items(one(_to_items(x, moves)), moves), mesh=mesh,
                               in_specs=spec, out_specs=spec, check_vma=False)(g))
    return out
  ns_dtype, iterate = _iterator(ns_dtype)
  sched = schedule(ns_schedule)
  mats = [_as_matrices(g, h) for g, h in zip(gs, headwise)]
  by_key: dict[tuple[int, int, bool], list[int]] = {}
  for i, x in enumerate(mats):
    by_key.setdefault(tuple(x.shape[-2:]) + (frozen[i],), []).append(i)
  out: list[jax.Array | None] = [None] * len(mats)
  for (_, _, skippable), idx in by_key.items():
    # Each item normalized, then rounded once to the iterate's dtype.
    items = [_normalized(mats[i], sched.margin).astype(_iterate_dtype(ns_dtype)) for i in idx]
    sizes = np.cumsum([w.shape[0] for w in items])[:-1]
    x = _run_chain(jnp.concatenate(items, axis=0), iterate, sched.coeffs, skippable)
    for i, y in zip(idx, jnp.split(x, sizes)):
      out[i] = _from_matrices(y, gs[i], headwise[i])
  return out


def orthogonalize(g: jax.Array, headwise: bool, ns_dtype: str = "float32",
                  ns_schedule: str = "spec") -> jax.Array:
  """Newton–Schulz over the last two axes, or over (in, head_dim) per head for `headwise`."""
  return orthogonalize_many([g], [headwise], ns_dtype, ns_schedule=ns_schedule)[0]


def matrix_dims(shape: tuple[int, ...], headwise: bool) -> tuple[int, int]:
  """(rows, cols) of each matrix that is orthogonalized on its own."""
  return (shape[-3], shape[-1]) if headwise else (shape[-2], shape[-1])


def rms_scale(shape: tuple[int, ...], headwise: bool, update_rms: float) -> float:
  """√max(m, n) · update_rms: the factor that gives an orthogonal m×n matrix RMS `update_rms`."""
  m, n = matrix_dims(shape, headwise)
  return update_rms * max(m, n) ** 0.5


def muon_direction(d: jax.Array, headwise: bool, update_rms: float,
                   ns_dtype: str = "float32", ns_schedule: str = "spec") -> jax.Array:
  """Orthogonalized direction scaled to RMS `update_rms` (√max(m, n) · update_rms · UVᵀ)."""
  scale = rms_scale(d.shape, headwise, update_rms)
  return (orthogonalize(d, headwise, ns_dtype, ns_schedule) * scale).astype(d.dtype)


class MuonState(NamedTuple):
  momentum: optax.Updates


def scale_by_muon(momentum: float, update_rms: float, headwise: Callable[[str], bool],
                  ns_dtype: str = "auto", frozen: Callable[[str], bool] = lambda path: False,
                  ns_schedule: str = "spec",
                  spec: Callable[[str], PartitionSpec | None] = lambda path: None
                  ) -> optax.GradientTransformation:
  """Nesterov momentum + Newton–Schulz (schedule `ns_schedule`) + RMS rescaling; `headwise(path)`
  picks the variant, `frozen(path)` marks parameters whose direction is zero while frozen,
  `spec(path)` is a parameter's layout on the mesh, if known (module docstring).

  All parameters' matrices are orthogonalized together (`orthogonalize_many`); on a mesh, with
  the layouts known, each parameter on its own, split by items over the devices."""

  def init_fn(params):
    return MuonState(momentum=table_lib.map_params(lambda _, p: jnp.zeros_like(p), params))

  def update_fn(updates, state, params=None):
    del params
    new_m = jax.tree.map(lambda m, g: momentum * m + g, state.momentum, updates)

    flat_g, treedef = jax.tree_util.tree_flatten_with_path(updates)
    flat_m = treedef.flatten_up_to(new_m)
    paths = [table_lib.path_str(p) for p, _ in flat_g]
    hw = [headwise(p) for p in paths]
    dirs = [g + momentum * m for (_, g), m in zip(flat_g, flat_m)]
    orth = orthogonalize_many(dirs, hw, ns_dtype, [frozen(p) for p in paths], ns_schedule,
                              [spec(p) for p in paths])
    out = [(o * rms_scale(d.shape, h, update_rms)).astype(d.dtype)
           for o, d, h in zip(orth, dirs, hw)]
    return jax.tree.unflatten(treedef, out), MuonState(momentum=new_m)

  return optax.GradientTransformation(init_fn, update_fn)
