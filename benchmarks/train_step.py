"""Benchmark of the training step on CPU (issue #4). Prints figures measured in one run.

The full compiled train step (forward, backward, clipping, AdamW) of the `make train` model,
fully tied CEM vs its untied Llama twin (same D, L, H, F, batch): tokens/s, their ratio (target:
tied ≥ 1.0× Llama), and MFU (target: Llama ≥ 40%) against the peak of
`cem_jax.train.metrics.peak_flops`: on CPU the jitted fp32 matmul of `matmul_peak_probe`, timed
interleaved with the train steps (so the machine's noise falls on both alike), on a known
accelerator its bf16 peak from the table. FLOPs per token:
`cem_jax.train.metrics.flops_per_token` (formula in its module).

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
from cem_jax.train.config import load_config
from cem_jax.train.metrics import flops_per_token, matmul_peak_probe, peak_flops
from cem_jax.train.step import Trainer

LLAMA = ["model.tie_attention=false", "model.tie_mlp=false", "model.preconditioner=none"]


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
    configs = {"tied CEM": load_config(args.config, args.overrides),
               "Llama twin": load_config(args.config, [*args.overrides, *LLAMA])}
    data = configs["tied CEM"].data
    B, T, V = data.batch_size, data.seq_len, data.vocab_size
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
    m = configs["tied CEM"].model
    print(f"train step, B={B}, T={T}, D={m.d_model}, L={m.num_layers}, H={m.num_heads}, "
          f"F={m.mlp_dim}, V={V}, {m.dtype} compute, {jax.device_count()} "
          f"{jax.devices()[0].device_kind} device(s); peak {peak / 1e9:,.0f} GFLOP/s ({source}); "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset: make bench sets it)')}")
    tps = {}
    for name, cfg in configs.items():
        tps[name] = B * T / times[name]
        flops = flops_per_token(cfg.model, T)
        print(f"  {name:10s}  {times[name] * 1e3:7.1f} ms/step  {tps[name]:8,.0f} tokens/s  "
              f"{flops / 1e6:5.1f} MFLOP/token  {flops * tps[name] / 1e9:5.1f} GFLOP/s  "
              f"MFU {flops * tps[name] / peak:5.1%}")
    ratio = tps["tied CEM"] / tps["Llama twin"]
    mfu = flops_per_token(configs["Llama twin"].model, T) * tps["Llama twin"] / peak
    print(f"tokens/s tied / Llama: {ratio:.2f}x (target >= 1.0)   "
          f"Llama MFU: {mfu:.1%} of the peak (target >= 40%)")


if __name__ == "__main__":
    main()
