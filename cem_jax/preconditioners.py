"""Preconditioners of the CEM step xᵏ⁺¹ = xᵏ + P·u: P positive definite by construction, and
when it can be folded into a mixer's output projection instead (DESIGN.md §1, "lightweight
preconditioner")."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cem_jax.updates import dense

Array = jax.Array


def precondition(kind: str, params: dict, u: Array) -> Array:
    """P·u for u [B,T,D] (DESIGN.md §1, "lightweight preconditioner").

    none: P = I. scalar: P = softplus(ρ)·I, ρ []. diag: P = diag(softplus(ρ)), ρ [D].
    dplr: P = diag(softplus(ρ)) + U Uᵀ, ρ [D], U [D,r] (positive definite for any U).
    Raises `ValueError` for an unknown kind.
    """
    if kind == "none":
        return u
    if kind not in ("scalar", "diag", "dplr"):
        raise ValueError(f"unknown preconditioner {kind!r}; use none, scalar, diag or dplr")
    out = jax.nn.softplus(params["rho"]).astype(u.dtype) * u
    if kind == "dplr":
        U = params["U"].astype(u.dtype)
        out = out + dense(dense(u, U), U.T)
    return out


def fold_preconditioner(kind: str, params: dict, impl: str, gradient_wrt: str) -> Array | None:
    """P's diagonal as fp32 [] (scalar) or [D] (diag) to fold into a mixer's output projection
    (params["out_scale"]: `diag(s) W u` costs a [D,·] weight scaling instead of a [B,T,D]
    product and its backward), or None where P cannot be folded: "none" and "dplr", the
    autodiff oracle (its direction is -∇E, not a projection), and a diagonal P with
    gradient_wrt="residual" (which does not commute with the RMSNorm VJP applied after).
    """
    if kind not in ("scalar", "diag") or impl == "autodiff":
        return None
    if kind == "diag" and gradient_wrt == "residual":
        return None
    return jax.nn.softplus(params["rho"].astype(jnp.float32))
