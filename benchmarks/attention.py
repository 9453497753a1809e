"""Benchmark of the tied-attention kernels (#5, #16). Prints measurements and ratios of one run.

1. Memory, on any machine: peak memory of jitted forward+backward (dq, dk of a scalar loss) of
   the Pallas kernel vs the XLA reference (`tied_attention_reference`, which materializes the
   [B,H,T,T] probabilities), at T = 1k…16k (compiled, not run: cheap on CPU), from the
   compiled executables' `memory_analysis()`: temp + output bytes (inputs are the same).
   On CPU the kernel runs in interpret mode: Pallas lowers it to a loop over the grid whose
   block buffers XLA allocates, so the analysis still measures the kernel's algorithm (tiles,
   not a T×T matrix), though not its on-chip buffers. The analytic bytes of what each saves
   for its backward pass (residuals) are printed beside it.
2. Speed, only on a GPU or TPU, at B=4, T=4096, H=16, K=128, bf16, causal: forward, backward
   alone and forward + backward time of the tied kernel against the strongest baseline, cuDNN's
   `jax.nn.dot_product_attention` both tied (q, k, k) and untied (q, k, v) (ratios first), and
   the kernel's forward TFLOP/s against the chip's bf16 peak (H200: 989 TFLOP/s dense). XLA's
   `dot_product_attention` is timed as context only (on a TPU, where there is no cuDNN, it is
   the only comparison). `--sweep` adds other kernel settings (`SWEEP`).

Run: `python benchmarks/attention.py [--memory-only | --speed-only] [--max-t 8192] [--sweep]`.
"""

from __future__ import annotations

import argparse
import dataclasses
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


# Settings tried by --sweep, as changes to the GPU defaults (64×64 tiles forward and backward,
# 4 warps, 3 pipelining stages forward and 2 backward, fused backward): the split backward (the
# dq and dk kernels of before, 7 tile matmuls a pair, no atomics), backward tiles and warps
# (the fused kernel keeps a dq tile more in registers), and two forward settings re-timed.
SWEEP = [dict(fused_bwd=False), dict(num_warps_bwd=8), dict(block_k_bwd=128, num_warps_bwd=8),
         dict(block_q_bwd=128, num_warps_bwd=8), dict(block_q_bwd=32), dict(num_stages_bwd=3),
         dict(num_stages_bwd=1), dict(block_k=128), dict(num_stages=4)]


def sweep_sizes(changes: dict) -> BlockSizes:
    return dataclasses.replace(BlockSizes.get_default("gpu"), **changes)


def _timed(fn, args):
    """Zero-argument calls of the forward, the backward alone (on residuals saved by one
    forward, cotangent fixed) and forward + backward (grad of Σ o²) of fn(*args)."""
    fwd = jax.jit(fn)
    o, vjp = jax.vjp(fwd, *args)
    ct = jax.random.normal(jax.random.PRNGKey(1), o.shape, o.dtype)
    bwd = jax.jit(lambda vjp, ct: vjp(ct))
    step = _loss(fn, len(args))
    return {"fwd": functools.partial(fwd, *args), "bwd": functools.partial(bwd, vjp, ct),
            "fwd+bwd": functools.partial(step, *args)}


def speed(B=4, T=4096, H=16, K=128, sweep=False):
    """Time the tied kernel against cuDNN's attention, tied (q,k,k) and untied (q,k,v), the
    strongest baseline on a GPU; XLA's attention is timed as context only."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (B, T, H, K), jnp.bfloat16) for key in keys)

    def dpa(q, k, v, impl):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    # name -> (attention function, its inputs); gradients are taken for every input, so the
    # untied contenders also compute dv.
    contenders = {"tied kernel": (tied_attention, (q, k))}
    for impl, label in [("cudnn", "cuDNN"), ("xla", "XLA")]:
        if impl == "cudnn" and jax.default_backend() != "gpu":
            continue
        contenders[f"{label} (q,k,k)"] = (lambda q, k, impl=impl: dpa(q, k, k, impl), (q, k))
        contenders[f"{label} untied (q,k,v)"] = (functools.partial(dpa, impl=impl), (q, k, v))
    calls = _compiled(contenders)
    report(median_times(calls, repeats=10, number=10), kind, B, T, H, K)
    if sweep:  # timed apart (a time limit hit here leaves the report above intact), interleaved
        # with the defaults and cuDNN, so its ratios are measured in the same noise
        tuned = {"tied " + " ".join(f"{key}={value}" for key, value in changes.items()):
                 (functools.partial(tied_attention, block_sizes=sweep_sizes(changes)), (q, k))
                 for changes in SWEEP}
        cudnn = any(name.startswith("cuDNN") for name, _ in calls)
        calls = {key: call for key, call in calls.items()
                 if not (cudnn and key[0].startswith("XLA"))}
        print("\nLaunch-setting sweep (the GPU defaults: BlockSizes.get_default('gpu')):")
        report(median_times({**calls, **_compiled(tuned)}, repeats=10, number=10),
               kind, B, T, H, K)


def _compiled(contenders: dict) -> dict:
    """(name, part) -> zero-argument call, each compiled and run once; a contender that fails
    (e.g. no cuDNN) is reported and left out."""
    calls = {}
    for name, (fn, args) in contenders.items():
        try:
            for part, call in _timed(fn, args).items():
                jax.block_until_ready(call())
                calls[name, part] = call
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"{name}: unavailable ({type(err).__name__}: {str(err)[:300]})")
            for part in ("fwd", "bwd", "fwd+bwd"):
                calls.pop((name, part), None)
    return calls


def report(t: dict, kind: str, B: int, T: int, H: int, K: int):
    """Print the ratios of the tied kernel to cuDNN, then every contender's times and
    throughput. t: (contender, "fwd" | "bwd" | "fwd+bwd") -> seconds."""
    names = list(dict.fromkeys(name for name, _ in t))
    flops = {"fwd": 2 * 2 * B * H * T * T * K / 2}  # two matmuls over half the square
    flops["bwd"] = 2.5 * flops["fwd"]  # five: FlashAttention's count, no recomputation
    known = table_peak_flops(kind)
    peak = known[1] if known else None
    tied = "tied kernel"
    baselines = [n for n in names if n.startswith("cuDNN")]
    if not baselines:
        baselines = [n for n in names if n.startswith("XLA")]
        print("\nNo cuDNN here: ratios against XLA's attention (context, not a strong "
              "baseline).")
    print(f"\nSpeed on {kind}, B={B} T={T} H={H} K={K} bf16 causal "
          "(median of 10 samples of 10 back-to-back calls; bwd: the backward alone).")
    if tied in names:
        for base in baselines:
            ratios = "   ".join(f"{part} {t[tied, part] / t[base, part]:.2f}"
                               for part in ("fwd", "bwd", "fwd+bwd"))
            print(f"tied kernel / {base}: time {ratios}   (target fwd+bwd ≤ 1.00)")
        if peak:
            print(f"tied kernel forward: {flops['fwd'] / t[tied, 'fwd'] / peak:.1%} of the "
                  f"{peak / 1e12:.0f} TFLOP/s bf16 peak (target ≥ 50%)")
    best = min(baselines, key=lambda n: t[n, "fwd+bwd"], default=None)
    print(f"  {'':<40} {'fwd ms':>8} {'bwd ms':>8} {'fwd+bwd':>8} {'÷ best':>7} "
          f"{'fwd TFLOP/s':>12} {'% peak':>7} {'bwd TFLOP/s':>12}   (÷ best: fwd+bwd time "
          f"over {best}'s; bwd FLOPs: 5 matmuls)")

    def row(name):
        fwd_tflops = flops["fwd"] / t[name, "fwd"] / 1e12
        pct = f"{fwd_tflops * 1e12 / peak:7.1%}" if peak else f"{'-':>7}"
        ratio = f"{t[name, 'fwd+bwd'] / t[best, 'fwd+bwd']:7.2f}" if best else f"{'-':>7}"
        print(f"  {name:<40} {t[name, 'fwd'] * 1e3:8.3f} {t[name, 'bwd'] * 1e3:8.3f} "
              f"{t[name, 'fwd+bwd'] * 1e3:8.3f} {ratio} {fwd_tflops:12.1f} {pct} "
              f"{flops['bwd'] / t[name, 'bwd'] / 1e12:12.1f}")

    context = [n for n in names if n.startswith("XLA") and n not in baselines]
    for name in names:
        if name not in context:
            row(name)
    if context:
        print("  context only, not a baseline: XLA's attention")
        for name in context:
            row(name)


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
