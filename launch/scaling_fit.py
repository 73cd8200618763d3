"""Scaling-law fits in numpy: L(C) = a·C^(−b) + c over a frontier, L(N, D) = E + A·N^(−α) + B·D^(−β).

Method (variable projection, no scipy): each law is linear in its coefficients once its exponents
are fixed. For every exponent on a grid (b: 400 values in [0.005, 2]; α × β: 100 × 100 in
[0.02, 2]²) the coefficients come from non-negative least squares (every subset of columns solved
exactly, negative solutions discarded), and the exponents with the least squared error win. A
Levenberg-damped Gauss–Newton refinement over all parameters starts there and is kept only if it
lowers the error with non-negative coefficients. Inputs are scaled by their geometric mean before
fitting (conditioning); the reported coefficients are in the original units.

    R² = 1 − Σ (L − L̂)² / Σ (L − mean L)²       residual = L − L̂   (over the fitted points)

The compute-optimal frontier of a grid: the Pareto points, whose loss is lower than that of every
point with as little compute or less.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass(frozen=True)
class Fit:
  law: str                      # "L(C) = a*C^-b + c" or "L(N,D) = E + A*N^-alpha + B*D^-beta"
  params: dict[str, float]
  r2: float
  residuals: tuple[float, ...]  # observed − fitted, in input order
  n_points: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def frontier(C, L) -> np.ndarray:
  """Indices (by increasing C) of the Pareto points: no other point has C and L both as low."""
  C, L = np.asarray(C, np.float64), np.asarray(L, np.float64)
  best, out = np.inf, []
  for i in np.lexsort((L, C)):
    if L[i] < best:
      out.append(i)
      best = L[i]
  return np.asarray(out, np.int64)


def _nnls_batched(X_GxPxK: np.ndarray, y_P: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Non-negative least squares for G small problems at once: (coef [G, K], SSE [G]).

  Every non-empty subset of the K columns is solved by its normal equations; solutions with a
  negative coefficient are discarded; the least SSE wins (exact NNLS for small K)."""
  G, _, K = X_GxPxK.shape
  best_sse = np.full((G,), np.inf)
  best = np.zeros((G, K))
  for r in range(1, K + 1):
    for cols in itertools.combinations(range(K), r):
      Xs = X_GxPxK[:, :, cols]
      A = np.einsum("gpi,gpj->gij", Xs, Xs)
      b = np.einsum("gpi,p->gi", Xs, y_P)
      with np.errstate(all="ignore"):
        ok = np.abs(np.linalg.det(A)) > 1e-300
        coef = np.zeros((G, r))
        coef[ok] = np.linalg.solve(A[ok], b[ok][..., None])[..., 0]
        sse = np.sum((np.einsum("gpi,gi->gp", Xs, coef) - y_P) ** 2, axis=1)
      good = ok & np.all(coef >= 0, axis=1) & np.isfinite(sse) & (sse < best_sse)
      full = np.zeros((G, K))
      full[:, cols] = coef
      best[good], best_sse[good] = full[good], sse[good]
  return best, best_sse


def _levenberg(resid, jac, theta: np.ndarray, valid, iters: int = 200) -> np.ndarray:
  """Minimise Σ resid(θ)² from θ (Levenberg–Marquardt); keeps only steps where valid(θ)."""
  lam = 1e-3
  sse = float(np.sum(resid(theta) ** 2))
  for _ in range(iters):
    r, J = resid(theta), jac(theta)
    A = J.T @ J
    g = J.T @ r
    try:
      step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -g)
    except np.linalg.LinAlgError:
      break
    cand = theta + step
    cand_sse = float(np.sum(resid(cand) ** 2)) if valid(cand) else np.inf
    if cand_sse < sse:
      theta, sse, lam = cand, cand_sse, lam / 3
      if np.max(np.abs(step) / (np.abs(theta) + 1e-12)) < 1e-12:
        break
    else:
      lam *= 10
      if lam > 1e12:
        break
  return theta


def _r2(y: np.ndarray, fitted: np.ndarray) -> float:
  sst = float(np.sum((y - y.mean()) ** 2))
  return 1.0 - float(np.sum((y - fitted) ** 2)) / sst if sst > 0 else float("nan")


def fit_power_law(C, L) -> Fit:
  """L(C) = a·C^(−b) + c, a, c ≥ 0 (see the module docstring); needs ≥ 3 points."""
  C, L = np.asarray(C, np.float64), np.asarray(L, np.float64)
  if len(C) < 3:
    raise ValueError(f"L(C) has 3 parameters; {len(C)} points cannot fit it")
  c0 = float(np.exp(np.mean(np.log(C))))
  x = C / c0
  bs = np.linspace(0.005, 2.0, 400)
  X = np.stack([x[None, :] ** -bs[:, None], np.ones((len(bs), len(x)))], axis=-1)
  coef, sse = _nnls_batched(X, L)
  g = int(np.argmin(sse))
  theta = np.array([coef[g, 0], bs[g], coef[g, 1]])

  def model(t):
    return t[0] * x ** -t[1] + t[2]

  def jac(t):
    p = x ** -t[1]
    return np.stack([p, -t[0] * np.log(x) * p, np.ones_like(x)], axis=1)

  theta = _levenberg(lambda t: model(t) - L, jac, theta,
                     valid=lambda t: t[0] >= 0 and t[1] > 0 and t[2] >= 0)
  a, b, c = theta
  fitted = model(theta)
  return Fit("L(C) = a*C^-b + c", {"a": float(a * c0 ** b), "b": float(b), "c": float(c)},
             _r2(L, fitted), tuple(float(v) for v in L - fitted), len(C))


def predict_power_law(fit: Fit, C) -> np.ndarray:
  p = fit.params
  return p["a"] * np.asarray(C, np.float64) ** -p["b"] + p["c"]


def fit_chinchilla(N, D, L) -> Fit:
  """L(N, D) = E + A·N^(−α) + B·D^(−β), E, A, B ≥ 0 (see the module docstring); ≥ 5 points."""
  N, D, L = (np.asarray(v, np.float64) for v in (N, D, L))
  if len(L) < 5:
    raise ValueError(f"L(N, D) has 5 parameters; {len(L)} points cannot fit it")
  n0, d0 = float(np.exp(np.mean(np.log(N)))), float(np.exp(np.mean(np.log(D))))
  n, d = N / n0, D / d0
  grid = np.linspace(0.02, 2.0, 100)
  al, be = (g.ravel() for g in np.meshgrid(grid, grid, indexing="ij"))
  X = np.stack([np.ones((len(al), len(n))), n[None] ** -al[:, None], d[None] ** -be[:, None]],
               axis=-1)
  coef, sse = _nnls_batched(X, L)
  g = int(np.argmin(sse))
  theta = np.array([coef[g, 0], coef[g, 1], al[g], coef[g, 2], be[g]])

  def model(t):
    return t[0] + t[1] * n ** -t[2] + t[3] * d ** -t[4]

  def jac(t):
    pn, pd = n ** -t[2], d ** -t[4]
    return np.stack([np.ones_like(n), pn, -t[1] * np.log(n) * pn, pd, -t[3] * np.log(d) * pd],
                    axis=1)

  theta = _levenberg(lambda t: model(t) - L, jac, theta,
                     valid=lambda t: t[0] >= 0 and t[1] >= 0 and t[3] >= 0 and t[2] > 0
                     and t[4] > 0)
  E, A, alpha, B, beta = theta
  fitted = model(theta)
  params = {"E": float(E), "A": float(A * n0 ** alpha), "alpha": float(alpha),
            "B": float(B * d0 ** beta), "beta": float(beta),
            # Compute-optimal allocation under C ∝ N·D: N_opt ∝ C^(β/(α+β)), D_opt ∝ C^(α/(α+β)).
            "n_opt_exponent": float(beta / (alpha + beta)),
            "d_opt_exponent": float(alpha / (alpha + beta))}
  return Fit("L(N,D) = E + A*N^-alpha + B*D^-beta", params, _r2(L, fitted),
             tuple(float(v) for v in L - fitted), len(L))


def predict_chinchilla(fit: Fit, N, D) -> np.ndarray:
  p = fit.params
  return (p["E"] + p["A"] * np.asarray(N, np.float64) ** -p["alpha"]
          + p["B"] * np.asarray(D, np.float64) ** -p["beta"])
