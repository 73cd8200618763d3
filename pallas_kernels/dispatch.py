"""The one dispatcher: every hot-path op with its reference, its kernels and the policy that picks (docs/design.md §T5).

An op is a pure function of arrays in `pallas_kernels.ops` (its *reference*, the definition). A
*kernel* computes the same function faster on some backend and shapes. Each op is registered once
below, in `OPS`, with

  reference    "module:function" of the op (imported on first use, like every entry here);
  kernels      its kernels, tried in order, each with
                 fn           "module:function", the op's signature (arrays positional, static
                              arguments keyword-only);
                 unsupported  (args, kwargs) -> why the kernel cannot run here (backend, shape,
                              dtype), or None;
                 faster       (args, kwargs) -> why "auto" does not take it although it could run
                              (it is not measured faster on this backend and shape), or None; the
                              rules cite benchmarks/RESULTS.md;
                 batched      one bool per positional argument: split over the mesh's batch axes,
                              or None when the kernel is not run per batch shard;
                 plan         "module:function" of the op's signature returning the work the
                              kernel can take back as `plan=`, a pytree of arrays with a leading
                              batch axis that depends on part of the arguments only (the
                              attention's slot order: top-k alone), or None;
  owner        "model" (policy in `ModelConfig.ops`) or "optim" (`OptimConfig`; the optimizer
               registers its rows when imported, `register`).

`call(name, *arrays, policy=..., **static)` runs the op under a policy:

  "reference"  the reference.
  "kernel"     the first kernel that can run; `PolicyError` naming the op, the policy and every
               kernel's reason when none can (wrong backend, unsupported shape).
  "auto"       the first kernel that can run and is measured faster here, else the reference; one
               log line per op and decision names the op and the reason. It never fails for
               lack of a kernel.

`make_plan(name, policy, *arrays, **static)` is (the implementation `call` will run, that
kernel's plan or None); arguments the plan does not read may be `jax.ShapeDtypeStruct`s. A caller
that makes one call per layer on the same selection makes the plan once and passes it to each
`call(..., plan=...)`; a plan given to a call that chooses another implementation is an error.

A batched kernel runs per batch shard under the ambient mesh (`sharded.over_batch`), here and
nowhere else: GSPMD does not partition a `pallas_call`. The reference runs as XLA code under GSPMD.

Adding a kernel: write it in one file of `pallas_kernels/` with the op's signature (its custom
VJP's backward may call the op's reference from `pallas_kernels.ops`), and add one `Kernel(...)`
to the op's row. A new op also needs a policy field in `ModelConfig.ops` (`OpPolicies`) or in
`OptimConfig`, whose tests check that the fields and the rows agree.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import logging
from typing import Any, Callable, Mapping

import jax

from pallas_kernels import sharded
from pallas_kernels.notices import log_once

POLICIES = ("auto", "reference", "kernel")


# The backend the rules decide for: jax's default backend, or the one `implementation` is asked
# about (a plan made on one machine for another: `launch.memory_plan` on the CPU for a GPU).
_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("dispatch_backend",
                                                                      default=None)


def backend() -> str:
  """The backend the kernel rules decide for (module doc of `implementation`)."""
  return _BACKEND.get() or jax.default_backend()


class PolicyError(ValueError):
  """An unknown policy, or "kernel" where no kernel of the op can run; names op, policy, reason."""


Rule = Callable[[tuple, Mapping[str, Any]], "str | None"]


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of an op (module doc)."""

  fn: str
  unsupported: Rule
  faster: Rule
  batched: tuple[bool, ...] | None = None
  plan: str | None = None


@dataclasses.dataclass(frozen=True)
class Op:
  """One registry row (module doc)."""

  reference: str
  kernels: tuple[Kernel, ...]
  owner: str = "model"
  default: str = "auto"


def _resolve(path: str) -> Callable:
  module, _, attr = path.partition(":")
  return getattr(importlib.import_module(module), attr)


# --- rules shared by the rows ------------------------------------------------------------------

def _triton(args, kwargs) -> str | None:
  """The Triton kernels run on a GPU, or interpreted on the CPU."""
  if backend() in ("gpu", "cpu"):
    return None
  return f"a Triton kernel (GPU; interpreted on CPU) cannot run on {backend()!r}"


def _module_reason(path: str) -> Rule:
  """The Triton backend rule, then the kernel module's `unsupported_reason(*args, **kwargs)`."""
  def rule(args, kwargs):
    return _triton(args, kwargs) or _resolve(path)(*args, **kwargs)
  return rule


def _gpu_only(measured: str) -> Rule:
  """Faster on the GPU (where `measured` says so); interpreted kernels elsewhere are slow."""
  def rule(args, kwargs):
    if backend() == "gpu":
      return None
    return f"measured faster on the GPU only ({measured}); {backend()} runs the reference"
  return rule


def _runs_anywhere(args, kwargs) -> str | None:
  """Pure jax: runs wherever the reference does."""
  return None


def _never(why: str) -> Rule:
  def rule(args, kwargs):
    return why
  return rule


def _inside(checks, where: str) -> str | None:
  """The first (outside?, what) of `checks` that is outside a measured envelope, as a reason."""
  for bad, what in checks:
    if bad:
      return f"{what} is outside the measured envelope ({where})"
  return None


# Sparse attention (`pallas_kernels.csa2_attention`, deterministic backward), forward + backward
# over the best XLA form on the H200 (RESULTS.md, "CSA2 global attention at s3's shapes"): 1.75x
# to 5.6x at every measured shape (16 heads x 128, window 128, top-256, ratios 1 and 2, 4K to 64K
# tokens), forward 2.7-4.4x; at top-512 (m3, s4; "Command buffers, the Triton select, top-512")
# 2.93x (ratio 1) and 1.74x (ratio 2) at 4K; with the fused global probabilities (2026-12-02,
# second session) 5.1x (ratio 1) and 2.6x (ratio 2) at 4K, top-256, making its plan in the call.
# Outside that envelope it is not measured, so "auto" keeps the XLA form.
SPARSE_ATTENTION_MEASURED = dict(head_dim=128, max_heads=16, max_window=128, max_topk=512,
                                 min_tokens=4096)


def _sparse_attention_faster(args, kwargs) -> str | None:
  if backend() != "gpu":
    return f"measured faster on the GPU only; {backend()} runs the reference"
  q, topk = args[0], args[5] if len(args) > 5 else None
  _, t, h, d = q.shape
  m = SPARSE_ATTENTION_MEASURED
  where = ("measured faster at 16 heads x 128, window 128, top-256 and top-512, 4K-64K tokens "
           "(RESULTS.md, 'CSA2 global attention at s3's shapes', 'Top-512')")
  if topk is None:
    return f"window-only attention is not measured ({where})"
  return _inside(((d != m["head_dim"], f"head_dim {d}"), (h > m["max_heads"], f"{h} heads"),
                  (kwargs["window"] > m["max_window"], f"window {kwargs['window']}"),
                  (topk.shape[-1] > m["max_topk"], f"top-{topk.shape[-1]}"),
                  (t < m["min_tokens"], f"{t} tokens per row")), where)


# The indexer's Triton kernel (scores, the radix select, the KL backward through the K selected
# entries), forward + backward over the XLA reference on the H200 (RESULTS.md, "The s3 step by
# source, kernels on and off"; "Command buffers, the Triton select, top-512"): with the Triton
# select, 2.86x at 4 x 4,096 tokens, 16 index heads x 128, top-256 (forward 2.17x) and 1.83x at
# top-512; with the selected-entry scores as Triton kernels too (2026-12-02, second session),
# 4.1x at top-256 (forward 3.0x). Only those shapes are measured, so "auto" keeps the XLA form
# elsewhere.
INDEXER_MEASURED = dict(head_dim=128, max_heads=16, max_topk=512, min_tokens=4096)


def _indexer_faster(args, kwargs) -> str | None:
  if backend() != "gpu":
    return f"measured faster on the GPU only; {backend()} runs the reference"
  _, t, h, d = args[0].shape
  k, m = kwargs["k"], INDEXER_MEASURED
  where = ("measured faster at 16 index heads x 128, top-256 and top-512, 4,096 tokens "
           "(RESULTS.md, 'The s3 step by source, kernels on and off', 'Top-512')")
  return _inside(((d != m["head_dim"], f"index_head_dim {d}"),
                  (h > m["max_heads"], f"{h} index heads"), (k > m["max_topk"], f"top-{k}"),
                  (t < m["min_tokens"], f"{t} tokens per row")), where)


def _mosaic_gpu(args, kwargs) -> str | None:
  """The Mosaic GPU kernels need a Hopper GPU (interpreted on the CPU): the module's own rule."""
  return _resolve("pallas_kernels.grouped_matmul:op_unsupported_reason")(*args)


# --- the registry ------------------------------------------------------------------------------

_FQ = "measured 1.6-1.9x XLA on the H200, RESULTS.md 'Pallas kernels vs XLA'"
_MHC_GATES = ("the Sinkhorn gates kernel 0.08 / 0.34 ms forward / forward+backward vs the "
              "fori_loop's 0.41-0.67 / 0.77-0.87 at s3 on the H200, RESULTS.md 'mHC site and "
              "routed experts'")
_MHC_SITE = ("the rows site (two Triton stream passes) 0.96-1.05 ms forward+backward vs the earlier "
             "kernel's 1.20-1.30 and the reference's 2.0 at s3 on an H100, the s3 step 0.6-1.1 % "
             "shorter, RESULTS.md 'The rows mHC site registered' (session 69)")

OPS: dict[str, Op] = {
    "fake_quant_fp4_main_kv": Op(
        "pallas_kernels.ops.quant:fake_quant_fp4_main_kv",
        (Kernel("pallas_kernels.fake_quant:fp4_main_kv_fake_quant",
                _module_reason("pallas_kernels.fake_quant:unsupported_fp4_main_kv"),
                _gpu_only(_FQ), batched=(True,)),)),
    "fake_quant_mxfp4": Op(
        "pallas_kernels.ops.quant:fake_quant_mxfp4",
        (Kernel("pallas_kernels.fake_quant:mxfp4_fake_quant",
                _module_reason("pallas_kernels.fake_quant:unsupported_mxfp4"),
                _gpu_only(_FQ), batched=(True,)),)),
    "fake_quant_fp8_swa": Op(
        "pallas_kernels.ops.quant:fake_quant_fp8_swa",
        (Kernel("pallas_kernels.fake_quant:fp8_swa_fake_quant",
                _module_reason("pallas_kernels.fake_quant:unsupported_fp8_swa"),
                _gpu_only(_FQ), batched=(True,)),)),
    "hc_coefficients": Op(
        "pallas_kernels.ops.mhc:hc_coefficients",
        (Kernel("pallas_kernels.mhc:hc_coefficients",
                _module_reason("pallas_kernels.mhc:unsupported_reason"),
                _gpu_only(_MHC_GATES), batched=(True, False, False, False)),)),
    "hc_site": Op(
        "pallas_kernels.ops.mhc:hc_site",
        (Kernel("pallas_kernels.mhc_rows:hc_site",
                _module_reason("pallas_kernels.mhc_rows:unsupported_reason"),
                _gpu_only(_MHC_SITE), batched=(True,) * 5 + (False,) * 4),)),
    "sparse_attention": Op(
        "pallas_kernels.ops.sparse_attention:attend",
        (Kernel("pallas_kernels.csa2_attention:sparse_attend",
                _module_reason("pallas_kernels.csa2_attention:unsupported_reason"),
                _sparse_attention_faster, batched=(True, True, True, False, True, True),
                plan="pallas_kernels.csa2_attention:slot_plan"),)),
    "indexer_topk": Op(
        "pallas_kernels.ops.indexer:score_and_select",
        (Kernel("pallas_kernels.indexer:indexer_topk",
                _module_reason("pallas_kernels.indexer:unsupported_reason"),
                _indexer_faster, batched=(True,) * 7),
         # Pure XLA, under GSPMD like the reference: not run per batch shard.
         Kernel("pallas_kernels.topk_select:score_and_select", _runs_anywhere,
                _never("the radix select alone is not faster than lax.top_k on the H200 "
                       "(4.51 vs 4.30 ms at 4 x 4,096 x top-256; scores + select 0.91x the "
                       "reference; RESULTS.md, 'The s3 step by source, kernels on and off')")))),
    # Not per batch shard: the MoE calls it inside its own shard_map, on expert-sorted rows.
    "grouped_matmul": Op(
        "pallas_kernels.ops.grouped_matmul:grouped_matmul",
        (Kernel("pallas_kernels.grouped_matmul:mosaic_grouped_matmul", _mosaic_gpu,
                _gpu_only("forward+backward 349 TFLOP/s vs ragged_dot's 8.3 on the H200, "
                          "RESULTS.md 'Grouped GEMM'")),)),
}


def register(name: str, op: Op) -> None:
  """Add the row of an op whose owner registers it at import (the optimizer's: `optim` is above
  this package, so its rows cannot be named here). Registering the same row again is a no-op."""
  if OPS.get(name, op) != op:
    raise ValueError(f"op {name!r} is already registered with another row")
  OPS[name] = op


# --- dispatch ----------------------------------------------------------------------------------

def names(owner: str | None = None) -> tuple[str, ...]:
  """The registered ops (of one owner: "model" or "optim")."""
  return tuple(n for n, op in OPS.items() if owner is None or op.owner == owner)


def default_policy(name: str) -> str:
  return _op(name).default


def _op(name: str) -> Op:
  if name not in OPS:
    raise KeyError(f"no op named {name!r}; registered: {sorted(OPS)}")
  return OPS[name]


def check_policy(name: str, policy: str) -> None:
  """PolicyError unless `policy` is one of POLICIES (the config checks with this at build time)."""
  _op(name)
  if policy not in POLICIES:
    raise PolicyError(f"op {name}: policy {policy!r} is not one of {', '.join(POLICIES)}")


def _per_shard(kernel: Kernel, fn: Callable) -> Callable:
  return fn if kernel.batched is None else sharded.over_batch(fn, kernel.batched)


def _select(name: str, policy: str, args, kwargs) -> tuple[Kernel | None, str]:
  """(the kernel `policy` takes for these arguments, "") or (None for the reference, the reasons
  every kernel was passed over)."""
  check_policy(name, policy)
  op = _op(name)
  if policy == "reference":
    return None, "policy 'reference'"
  reasons = []
  for k in op.kernels:
    if k.batched is not None and len(args) != len(k.batched):
      raise TypeError(f"op {name} takes {len(k.batched)} array arguments positionally "
                      f"(got {len(args)})")
    why = k.unsupported(args, kwargs)
    if why is None and policy == "auto":
      why = k.faster(args, kwargs)
    if why is None:
      return k, ""
    reasons.append(f"{k.fn}: {why}")
  reason = "; ".join(reasons) or "no kernel is registered"
  if policy == "kernel":
    raise PolicyError(f"op {name}: policy 'kernel' cannot run here: {reason}")
  return None, reason


def choose(name: str, policy: str, *args, **kwargs) -> tuple[str, Callable]:
  """(the implementation's "module:function", the callable `call` runs) for these arguments."""
  k, reason = _select(name, policy, args, kwargs)
  if k is not None:
    if policy == "auto":
      log_once((name, k.fn), f"op {name}: policy 'auto' runs the kernel {k.fn}", logging.INFO)
    return k.fn, _per_shard(k, _resolve(k.fn))
  path = _op(name).reference
  if policy == "auto":
    log_once((name, reason), f"op {name}: policy 'auto' runs the reference ({reason})",
             logging.INFO)
  return path, _resolve(path)


def implementation(name: str, policy: str, *args, backend: str, **kwargs) -> str:
  """The "module:function" that `call` would run for these arguments on `backend` ("gpu", "cpu",
  "tpu"), deciding by the same rules without running or logging anything; the arrays may be
  `jax.ShapeDtypeStruct`s. For plans made on one machine about another (`launch.memory_plan`);
  `PolicyError` as `call` would raise it there."""
  token = _BACKEND.set(backend)
  try:
    k, _ = _select(name, policy, args, kwargs)
  finally:
    _BACKEND.reset(token)
  return _op(name).reference if k is None else k.fn


def _kernel(name: str, path: str) -> Kernel | None:
  return next((k for k in _op(name).kernels if k.fn == path), None)


def make_plan(name: str, policy: str, *args, **kwargs) -> tuple[str, Any]:
  """(the implementation `call` runs for these arguments, its kernel's plan or None) (module doc)."""
  path, _ = choose(name, policy, *args, **kwargs)
  k = _kernel(name, path)
  if k is None or k.plan is None:
    return path, None
  return path, _resolve(k.plan)(*args, **kwargs)


def call(name: str, *args, policy: str, plan: Any = None, **kwargs):
  """Op `name` on `args` (arrays, positional) and `kwargs` (static) under `policy` (module doc);
  `plan`: the chosen kernel's plan of these arguments, from `make_plan`."""
  path, fn = choose(name, policy, *args, **kwargs)
  if plan is None:
    return fn(*args, **kwargs)
  k = _kernel(name, path)
  if k is None or k.plan is None:
    raise ValueError(f"op {name}: a plan was given, but {path} runs here and takes none (the plan "
                     "was made for other arguments or another policy)")
  kernel = _resolve(k.fn)

  def with_plan(*a):
    return kernel(*a[:-1], plan=a[-1], **kwargs)
  if k.batched is not None:
    with_plan = sharded.over_batch(with_plan, k.batched + (True,))
  return with_plan(*args, plan)


def kernel_names() -> tuple[tuple[str, str], ...]:
  """(op, kernel "module:function") of every registered kernel."""
  return tuple((n, k.fn) for n, op in OPS.items() for k in op.kernels)
