"""What the TPU compiler says of our steps and kernels, from a host without a TPU (libtpu,
`cem_jax.train.targets`; DESIGN.md §6). Two parts, each a table:

  ladder: the train step of each rung of the scale ladder (the 100M tied CEM and its Llama
    twin on a v5p-32; the ~1B and ~8B ones on the smallest v5p slice each fits in, by trying
    4, 8, 16, ... chips), on 1 and on 2 slices: compile time, memory per chip (the compiler's
    peak against the chip's HBM, FIT_SHARE at most), ICI and DCN bytes per chip per step, DCN
    against one all-reduce of the chip's gradient shard (its bound), the compiler's FLOPs per
    chip (loop bodies once) and 6 x parameters x tokens per chip.
  kernels: the tied-attention Pallas kernel, forward and backward, compiled by Mosaic for v4,
    v5e, v5p and v6e at K in {64, 128, 256}, bf16 and fp32, H/G in {1, 4}, T in {128, 2048,
    32768}, with segment ids, at the default `BlockSizes`: the scoped VMEM the compiler reports
    for each kernel beside `vmem_lower_bound` and the generation's limit.

    python benchmarks/tpu_compile.py [--part ladder|kernels|all] [--out FILE]

Compile times are this host's (2 shared cores here): a note, not a target.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu only as the compiler (targets.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from cem_jax.kernels import BlockSizes, tied_attention  # noqa: E402
from cem_jax.kernels.common import KernelParams, round_up  # noqa: E402
from cem_jax.kernels.tpu import SCOPED_VMEM, SCOPED_VMEM_DEFAULT, vmem_lower_bound  # noqa: E402
from cem_jax.memory import DoesNotFit  # noqa: E402
from cem_jax.train import hlo, load_config  # noqa: E402
from cem_jax.train.targets import (  # noqa: E402
    FIT_SHARE,
    parse_target,
    step_on_target,
    topology_devices,
    tpu_compiler,
)

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
# (config, targets tried in order, overrides on one slice, on two)
RUNGS = [
    ("cem_full_100m", ["tpu-v5p-32"], ["model.impl=pallas"],
     ["model.impl=pallas", "mesh.data=-1", "mesh.fsdp=8"]),
    ("llama_100m", ["tpu-v5p-32"], ["model.impl=pallas"],
     ["model.impl=pallas", "mesh.data=-1", "mesh.fsdp=8"]),
    ("cem_full_1b", ["tpu-v5p-8", "tpu-v5p-16", "tpu-v5p-32"], [], ["mesh.data=2"]),
    ("llama_1b", ["tpu-v5p-8", "tpu-v5p-16", "tpu-v5p-32"], [], ["mesh.data=2"]),
    ("cem_full_8b", ["tpu-v5p-8", "tpu-v5p-16", "tpu-v5p-32"], [], ["mesh.data=2"]),
    ("llama_8b", ["tpu-v5p-8", "tpu-v5p-16", "tpu-v5p-32", "tpu-v5p-64"], [], ["mesh.data=2"]),
]
GENERATIONS = ["tpu-v4-8", "tpu-v5litepod-4", "tpu-v5p-8", "tpu-v6e-4"]


def _step(config: str, target: str, overrides: list[str], slices: int) -> dict | None:
    cfg = load_config(REPO / "configs" / f"{config}.yaml",
                      [*overrides, f"mesh.num_slices={slices}"])
    try:
        return step_on_target(cfg, parse_target(target), echo=lambda _: None)
    except DoesNotFit as err:
        print(f"  {config} on {target} x{slices}: does not fit ({str(err)[:90]}...)",
              flush=True)
        return None


def _row(config: str, target: str, slices: int, r: dict) -> str:
    ici = sum(p["bytes"] for p in r["collectives"]["ici"].values())
    dcn = sum(p["bytes"] for p in r["collectives"]["dcn"].values())
    dcn_kinds = "+".join(sorted(r["collectives"]["dcn"])) or "-"
    mem, fl = r["memory"], r["flops"]
    compiler = fl["compiler_per_chip"] or float("nan")
    bound = f"{dcn / r['dcn_bound']:.2f}" if slices > 1 else "-"
    return (f"| {config} | {target} x{slices} | {r['mesh']['data']}/{r['mesh']['fsdp']}/"
            f"{r['mesh']['tensor']} | {r['params']['total'] / 1e9:.3f} | {r['compile_s']:.0f} | "
            f"{mem['arguments'] / 2**30:.2f} | {mem['temp'] / 2**30:.2f} | "
            f"{mem['total'] / 2**30:.2f} ({mem['share']:.0%}) | {ici / MIB:,.0f} | "
            f"{dcn / MIB:,.1f} {dcn_kinds} | {r['dcn_bound'] / MIB:,.1f} | {bound} | "
            f"{compiler:.3g} | {fl['six_n_per_chip']:.3g} | {sum(r['kernels'].values())} |")


def ladder(say) -> None:
    say("## The scale ladder: the train step compiled for v5p slices\n")
    say("Per chip and step. data/fsdp/tensor: the mesh. peak: arguments + outputs - aliased + "
        "temporaries + code, of the chip's 95 GB. ICI, DCN: the bytes of the collectives' "
        "buffers (`cem_jax.train.hlo`). bound: one all-reduce of the chip's gradient shard "
        "(its parameter shard's bytes). compiler FLOPs: cost_analysis, a loop's body counted "
        "once (the layer scan: once for all layers). 6ND: 6 x parameters x tokens per chip. "
        "kernels: Mosaic kernel calls per step.\n")
    say("| config | target | mesh d/f/t | params (B) | compile s | arguments GiB | temp GiB | "
        "peak GiB | ICI MiB | DCN MiB | bound MiB | DCN/bound | compiler FLOPs | 6ND | "
        "kernels |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config, targets, one, two in RUNGS:
        for target in targets:
            r = _step(config, target, one, 1)
            if r is not None and r["memory"]["share"] <= FIT_SHARE:
                break
        else:
            say(f"| {config} | none of {', '.join(targets)} fits |")
            continue
        say(_row(config, target, 1, r))
        r2 = _step(config, target, two, 2)
        say(_row(config, target, 2, r2) if r2 is not None else
            f"| {config} | {target} x2 | does not fit |")


def _kernel(device, B: int, T: int, H: int, G: int, K: int, dtype) -> dict:
    q = jax.ShapeDtypeStruct((B, T, H, K), dtype)
    k = jax.ShapeDtypeStruct((B, T, G, K), dtype)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def grads(q, k, seg):
        def loss(q, k):
            out = tied_attention(q, k, segment_ids=seg, backend="tpu", interpret=False)
            return out.astype(jnp.float32).sum()
        return jax.grad(loss, (0, 1))(q, k)

    start = time.perf_counter()
    with jax.default_device(device):
        compiled = jax.jit(grads).trace(q, k, seg).lower().compile()
    found = hlo.analyze(compiled.as_text())
    return {"s": time.perf_counter() - start, **found}


def kernels(say) -> None:
    bs = BlockSizes.get_default("tpu")
    say("\n## The tied-attention kernel compiled by Mosaic, forward and backward\n")
    say(f"Default BlockSizes {bs.blocks} on every generation, segment ids on, B=1, G=2. VMEM: "
        "the scoped VMEM the compiler reports for each kernel (fwd/dq/dk, MiB; at these small "
        "tiles it leaves out part of the pipeline's buffers, so it can be under the bound) and "
        "`vmem_lower_bound`; limit: the scoped VMEM Mosaic gives a kernel there.\n")
    say("| target | K | dtype | H/G | T | compile s | VMEM fwd/dq/dk MiB | lower bound MiB | "
        "limit MiB |")
    say("|---|---|---|---|---|---|---|---|---|")
    failed = 0
    for name in GENERATIONS:
        target = parse_target(name)
        device = topology_devices(target, 1)[0]
        limit = SCOPED_VMEM.get(target.device.device_kind, SCOPED_VMEM_DEFAULT)
        for K, dtype, ratio, T in itertools.product((64, 128, 256), (jnp.bfloat16, jnp.float32),
                                                    (1, 4), (128, 2048, 32768)):
            G = 2
            try:
                r = _kernel(device, 1, T, G * ratio, G, K, dtype)
            except Exception as err:  # a case that does not compile is a finding: say it
                failed += 1
                say(f"| {name} | {K} | {jnp.dtype(dtype).name} | {ratio} | {T} | FAILED: "
                    f"{str(err).splitlines()[0][:120]} |")
                continue
            blocks = [min(b, 1 << (T - 1).bit_length()) for b in bs.blocks]
            p = KernelParams(causal=True, scale=1.0, kv_len=None, ratio=ratio,
                             block_q=blocks[0], block_k=blocks[1], block_q_bwd=blocks[2],
                             block_k_bwd=blocks[3])
            est = vmem_lower_bound(p, round_up(K, 128), jnp.dtype(dtype).itemsize)
            got = [r["kernel_vmem"][f"cem_tied_attention_{k}_tpu"] for k in ("fwd", "dq", "dk")]
            say(f"| {name} | {K} | {jnp.dtype(dtype).name} | {ratio} | {T} | {r['s']:.1f} | "
                + "/".join(f"{v / MIB:.2f}" for v in got) + " | "
                + "/".join(f"{est[k] / MIB:.2f}" for k in ("fwd", "dq", "dk"))
                + f" | {limit // MIB} |")
    say(f"\n{failed} case(s) failed to compile.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("ladder", "kernels", "all"), default="all")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    args = parser.parse_args()
    compiler = tpu_compiler()
    if compiler is None:
        print("libtpu is not installed: pip install -e '.[tpu]' (or '.[dev]')", file=sys.stderr)
        return 2
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"# TPU compile ({compiler}, jax {jax.__version__}, on {os.cpu_count()} CPU cores; "
        f"`python benchmarks/tpu_compile.py --part {args.part}`)\n")
    if args.part in ("ladder", "all"):
        ladder(say)
    if args.part in ("kernels", "all"):
        kernels(say)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
