"""Benchmark of the training step (issues #4, #16). Prints figures measured in one run.

The full compiled train step (forward, backward, clipping, AdamW) of a config, fully tied CEM vs
its untied Llama twin (same D, L, H, F, batch), against the strongest baseline a user would run
on the platform: on a GPU the Llama twin with cuDNN's flash attention (`model.impl=cudnn`, bf16),
beside which the tied model runs with every core it has (xla, the Pallas kernel, cuDNN) and the
Llama twin on XLA's attention is printed as context only; on CPU both run the XLA core (the
Pallas kernel there is an interpreter, cuDNN absent). Tokens/s, ratios to the baseline row
(target: tied ≥ 1.0×), and MFU (target: the baseline ≥ 40%) against the peak of
`cem_jax.train.metrics.peak_flops`: on CPU the jitted fp32 matmul of `matmul_peak_probe`, timed
interleaved with the train steps (so the machine's noise falls on all alike), on a known
accelerator its bf16 peak from the table. FLOPs per token:
`cem_jax.train.metrics.flops_per_token` (formula in its module; recomputation under
`model.remat=full` is work MFU does not count, so a GPU run may pass `model.remat=none` where
memory allows, and says so in its command line).

Run it as `make bench` does, with the Makefile's GLIBC_TUNABLES (malloc huge pages: fewer page
faults on XLA's per-step buffers; the script prints the setting it ran with):
`python benchmarks/train_step.py [--config configs/shakespeare_cem.yaml] [key=value ...]`
(on one GPU, e.g. `--config configs/cem_full_100m.yaml data.batch_size=32`).
"""

import argparse
import os

import jax
import numpy as np
from timing import median_times

from cem_jax.sharding import global_batch, make_mesh
from cem_jax.train.metrics import flops_per_token, matmul_peak_probe, peak_flops
from cem_jax.train.step import Trainer
from cem_jax.train_config import load_config

LLAMA = ["model.tie_attention=false", "model.tie_mlp=false", "model.preconditioner=none"]


def rows(on_gpu: bool) -> tuple[dict[str, list[str]], str]:
    """{row name: config overrides} and the baseline row's name."""
    if not on_gpu:
        return {"tied CEM": [], "Llama twin": LLAMA}, "Llama twin"
    return {"tied CEM (xla)": ["model.impl=xla"], "tied CEM (pallas)": ["model.impl=pallas"],
            "tied CEM (cudnn)": ["model.impl=cudnn"],
            "Llama twin (cudnn)": [*LLAMA, "model.impl=cudnn"],
            "Llama twin (xla, context only)": [*LLAMA, "model.impl=xla"]}, "Llama twin (cudnn)"


def step_fn(cfg, batch):
    """A zero-argument function running one train step (carrying the donated state)."""
    mesh = make_mesh(cfg.mesh)
    trainer = Trainer(cfg.model, cfg.optimizer, cfg.run.steps, mesh)
    holder = {"state": trainer.init(0)}
    batch = global_batch(batch, mesh)

    def run():
        holder["state"], metrics = trainer.train_step(holder["state"], batch)
        return metrics

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/shakespeare_cem.yaml")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    names, baseline = rows(on_gpu)
    configs = {name: load_config(args.config, [*args.overrides, *extra])
               for name, extra in names.items()}
    data = configs[baseline].data
    B, T, V = data.batch_size, data.seq_len, configs[baseline].model.vocab_size
    tokens = np.random.default_rng(0).integers(4, V, (B, T + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "segment_ids": np.ones((B, T), np.int32),
             "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}
    fns = {name: step_fn(cfg, batch) for name, cfg in configs.items()}
    if jax.default_backend() == "cpu":
        fns["peak"], probe_flops = matmul_peak_probe()
    times = median_times(fns, args.repeats)
    if "peak" in times:
        peak, source = probe_flops / times["peak"], "fp32 matmul, same run"
    else:
        peak, source = peak_flops(None)
    m = configs[baseline].model
    print(f"train step, B={B}, T={T}, D={m.d_model}, L={m.num_layers}, H={m.num_heads}, "
          f"F={m.mlp_dim}, V={V}, {m.dtype} compute, remat={m.remat}, {jax.device_count()} "
          f"{jax.devices()[0].device_kind} device(s); peak {peak / 1e9:,.0f} GFLOP/s ({source}); "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset: make bench sets it)')}")
    tps = {name: B * T / times[name] for name in configs}
    for name, cfg in configs.items():
        flops = flops_per_token(cfg.model, T)
        print(f"  {name:32s}  {times[name] * 1e3:7.1f} ms/step  {tps[name]:9,.0f} tokens/s  "
              f"{tps[name] / tps[baseline]:5.2f}x  {flops / 1e6:6.1f} MFLOP/token  "
              f"MFU {flops * tps[name] / peak:5.1%}")
    tied = max((n for n in configs if n.startswith("tied")), key=tps.get)
    mfu = flops_per_token(configs[baseline].model, T) * tps[baseline] / peak
    print(f"tokens/s {tied} / {baseline}: {tps[tied] / tps[baseline]:.2f}x (target >= 1.0)   "
          f"{baseline} MFU: {mfu:.1%} of the peak (target >= 40%)")


if __name__ == "__main__":
    main()
