"""Helpers shared by the tests: tolerances and explicit reference matrices."""

import math

import numpy as np


def assert_close_to_scale(got, want, tol=1e-5):
    """max |got - want| ≤ tol · max |want| (error relative to the output scale)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want)), 1e-12)
    err = np.max(np.abs(got - want)) / scale
    assert err <= tol, f"relative max error {err:.3g} > {tol}"


def rotation_matrix(pos, K, theta=10000.0):
    """Explicit RoPE matrix R_t [K,K] in the half-split (Hugging Face Llama) convention."""
    half = K // 2
    R = np.zeros((K, K))
    for i in range(half):
        ang = pos * theta ** (-i / half)
        c, s = math.cos(ang), math.sin(ang)
        R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
    return R
