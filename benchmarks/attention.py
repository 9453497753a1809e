"""Benchmark of the tied-attention kernels (issue #5). Prints measurements and ratios of one run.

1. Memory, on any machine: peak memory of jitted forward+backward (dq, dk of a scalar loss) of
   the Pallas kernel vs the XLA reference (`tied_attention_reference`, which materializes the
   [B,H,T,T] probabilities), at T = 1k…16k (compiled, not run: cheap on CPU), from the
   compiled executables' `memory_analysis()`: temp + output bytes (inputs are the same).
   On CPU the kernel runs in interpret mode: Pallas lowers it to a loop over the grid whose
   block buffers XLA allocates, so the analysis still measures the kernel's algorithm (tiles,
   not a T×T matrix), though not its on-chip buffers. The analytic bytes of what each saves
   for its backward pass (residuals) are printed beside it.
2. Speed, only on a GPU or TPU: forward+backward time of the tied kernel vs
   `jax.nn.dot_product_attention(q, k, k)` (XLA and, on GPU, cuDNN) and vs untied attention
   (q, k, v) of the same shape, at B=4, T=4096, H=16, K=128, bf16, causal; and the kernel's
   forward TFLOP/s against the chip's bf16 peak (H200: 989 TFLOP/s dense).

Run: `python benchmarks/attention.py [--memory-only | --speed-only] [--max-t 8192] [--sweep]`.
"""

from __future__ import annotations

import argparse
import functools
import math
import platform

import jax
import jax.numpy as jnp
from timing import median_times

from cem_jax.kernels import BlockSizes, tied_attention, tied_attention_reference
from cem_jax.train.metrics import table_peak_flops


def _loss(fn, num_args=2):
    """jit(grad) of Σ fn(...)² with respect to all `num_args` inputs."""
    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, argnums=tuple(range(num_args))))


def _peak_bytes(step, q, k) -> int | None:
    analysis = step.lower(q, k).compile().memory_analysis()
    if analysis is None:
        return None
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def memory_curves(max_t: int, B=1, H=2, K=64):
    on_cpu = jax.default_backend() == "cpu"
    kernel = _loss(lambda q, k: tied_attention(q, k, backend=None if not on_cpu else "gpu",
                                               interpret=True if on_cpu else None))
    ref = _loss(lambda q, k: tied_attention_reference(q, k)[0])
    mode = "interpret mode (CPU)" if on_cpu else "compiled"
    print(f"Memory of jitted fwd+bwd, B={B} H={H} K={K} fp32 causal; kernel {mode} "
          f"vs XLA reference (temp + output bytes of the compiled executable):")
    print(f"{'T':>6} {'kernel MiB':>11} {'ref MiB':>10} {'ref/kernel':>10} "
          f"{'kernel resid MiB':>17} {'ref resid MiB':>14}")
    rows = []
    T = 1024
    while T <= max_t:
        q = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
        kern, refb = _peak_bytes(kernel, q, q), _peak_bytes(ref, q, q)
        # Saved for the backward pass: kernel q, k, o, lse; reference q, k and p [B,H,T,T] fp32.
        resid_kernel = 4 * (3 * B * T * H * K + B * H * T)
        resid_ref = 4 * (2 * B * T * H * K + B * H * T * T)
        rows.append((T, kern, refb))
        mib = 2.0**20
        print(f"{T:>6} {kern / mib:>11.1f} {refb / mib:>10.1f} {refb / kern:>10.1f} "
              f"{resid_kernel / mib:>17.2f} {resid_ref / mib:>14.1f}")
        T *= 2
    (t0, k0, r0), (t1, k1, r1) = rows[0], rows[-1]
    growth = math.log(t1 / t0)
    print(f"growth exponent from T={t0} to T={t1} (1 = linear, 2 = quadratic): "
          f"kernel {math.log(k1 / k0) / growth:.2f}, reference {math.log(r1 / r0) / growth:.2f}")


# BlockSizes tried by --sweep besides the GPU defaults (64×64 tiles, 4 warps, 3 stages forward
# and 2 backward): (block_q, block_k, num_warps, num_stages) of the forward, then the same of
# the backward. Forward and backward settings are independent: each row varies one side.
SWEEP = [((64, 64, 4, 4), (64, 64, 4, 2)), ((128, 64, 8, 3), (64, 64, 4, 2)),
         ((128, 64, 8, 4), (64, 64, 4, 2)), ((64, 128, 4, 3), (64, 64, 4, 2)),
         ((128, 128, 8, 2), (64, 64, 4, 2)), ((64, 64, 4, 3), (32, 64, 4, 2)),
         ((64, 64, 4, 3), (64, 64, 8, 2)), ((64, 64, 4, 3), (64, 128, 8, 2)),
         ((64, 64, 4, 3), (128, 64, 8, 2)), ((64, 64, 4, 3), (64, 64, 4, 1))]


def sweep_sizes(fwd, bwd) -> BlockSizes:
    return BlockSizes(block_q=fwd[0], block_k=fwd[1], num_warps=fwd[2], num_stages=fwd[3],
                      block_q_bwd=bwd[0], block_k_bwd=bwd[1], num_warps_bwd=bwd[2],
                      num_stages_bwd=bwd[3])


def speed(B=4, T=4096, H=16, K=128, sweep=False):
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (B, T, H, K), jnp.bfloat16) for key in keys)

    def dpa(q, k, v, impl):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    # name -> (attention function, its inputs); gradients are taken for every input, so the
    # untied contender also computes dv.
    contenders = {"tied kernel": (tied_attention, (q, k))}
    for impl in ["xla", "cudnn"] if jax.default_backend() == "gpu" else ["xla"]:
        contenders[f"dpa {impl} (q,k,k)"] = (lambda q, k, impl=impl: dpa(q, k, k, impl), (q, k))
        contenders[f"dpa {impl} untied (q,k,v)"] = (functools.partial(dpa, impl=impl), (q, k, v))
    if sweep:
        for fwd, bwd in SWEEP:
            name = "tied q{}k{}w{}s{} bwd q{}k{}w{}s{}".format(*fwd, *bwd)
            contenders[name] = (functools.partial(tied_attention,
                                                  block_sizes=sweep_sizes(fwd, bwd)), (q, k))
    steps, forwards = {}, {}
    for name, (fn, args) in contenders.items():
        try:
            step, fwd = _loss(fn, len(args)), jax.jit(fn)
            jax.block_until_ready(step(*args))
            steps[name] = functools.partial(step, *args)
            forwards[name] = functools.partial(fwd, *args)
        except Exception as err:  # noqa: BLE001 - report and go on (e.g. cuDNN unavailable)
            print(f"{name}: unavailable ({type(err).__name__}: {str(err)[:300]})")
    t = median_times(steps, repeats=10, number=10)
    tf = median_times(forwards, repeats=10, number=10)
    flops_fwd = 2 * 2 * B * H * T * T * K / 2  # two matmuls, half the square (causal)
    print(f"\nSpeed on {kind}, B={B} T={T} H={H} K={K} bf16 causal "
          "(median of 10 samples of 10 back-to-back calls):")
    for name in steps:
        print(f"  {name:<34} fwd+bwd {t[name] * 1e3:8.3f} ms   fwd {tf[name] * 1e3:7.3f} ms "
              f"({flops_fwd / tf[name] / 1e12:6.1f} TFLOP/s)   "
              f"fwd+bwd ratio to tied {t[name] / t['tied kernel']:.2f}")
    others = [n for n in steps if not n.startswith("tied")]
    if "tied kernel" in steps and others:
        best = min(others, key=lambda n: t[n])
        print(f"tied kernel / best other ({best}) fwd+bwd time: "
              f"{t['tied kernel'] / t[best]:.2f} (target ≤ 1.00)")
        best_fwd = min(others, key=lambda n: tf[n])
        print(f"tied kernel / best other ({best_fwd}) fwd time: "
              f"{tf['tied kernel'] / tf[best_fwd]:.2f}")
    known = table_peak_flops(kind)
    if known and "tied kernel" in tf:
        peak = known[1] / 1e12
        frac = flops_fwd / tf["tied kernel"] / 1e12 / peak
        print(f"tied kernel forward: {frac:.1%} of the {peak:.0f} TFLOP/s bf16 peak "
              f"(target ≥ 50%)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--speed-only", action="store_true", help="skip the memory curves")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the kernel with other block sizes (GPU/TPU)")
    parser.add_argument("--max-t", type=int, default=None,
                        help="largest T of the memory curve (default 16384)")
    args = parser.parse_args()
    backend = jax.default_backend()
    print(f"jax {jax.__version__} on {backend} ({platform.machine()}), "
          f"device {jax.devices()[0].device_kind}")
    if not args.speed_only:
        memory_curves(args.max_t or 16384)
    if backend in ("gpu", "tpu") and not args.memory_only:
        speed(sweep=args.sweep)
    elif not args.memory_only:
        print("\nSpeed comparison skipped: it needs a GPU or TPU (none here).")


if __name__ == "__main__":
    main()
