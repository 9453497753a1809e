"""Benchmark of cached decoding on CPU (issue #6): the tied CEM model against its Llama baseline
twin at the same shape (D=256, L=4, H=G=4, K=64, F=704, V=2048; batch 8, prompt 16, 256 new
tokens, greedy), measured in one run with interleaved repeats.

Prints each model's decode tokens/s (prompt evaluation included, one compiled loop) and cache
bytes. Targets: tied cache = 0.5× the baseline's key/value cache; tied decode not slower
(time ratio ≤ 1).

Run: `python benchmarks/decode.py`.
"""

import numpy as np
from flax import nnx
from timing import median_times

from cem_jax.config import ModelConfig
from cem_jax.model import CEMTransformer
from cem_jax.sample import SamplingConfig, generate

BATCH, PROMPT, NEW = 8, 16, 256


def main():
    shape = dict(vocab_size=2048, d_model=256, num_layers=4, num_heads=4, mlp_dim=704)
    configs = {"baseline": ModelConfig(**shape, tie_attention=False, tie_mlp=False,
                                       preconditioner="none"),
               "tied": ModelConfig(**shape)}
    prompts = np.random.default_rng(0).integers(4, 2048, (BATCH, PROMPT)).tolist()
    sampling = SamplingConfig(max_new_tokens=NEW, temperature=0.0)
    calls, bytes_ = {}, {}
    for name, cfg in configs.items():
        params = nnx.to_pure_dict(nnx.state(CEMTransformer(cfg, rngs=nnx.Rngs(0))))
        bytes_[name] = generate(params, cfg, prompts, sampling).cache_bytes
        calls[name] = lambda params=params, cfg=cfg: generate(params, cfg, prompts, sampling)
    seconds = median_times(calls, repeats=5)
    print(f"cached decoding, batch {BATCH}, prompt {PROMPT}, {NEW} new tokens, "
          f"{shape} (CPU, median of 5)")
    for name in configs:
        print(f"  {name:8s}: {BATCH * NEW / seconds[name]:8.0f} tokens/s, "
              f"cache {bytes_[name] / 2**20:.2f} MiB")
    print(f"tied / baseline: cache bytes {bytes_['tied'] / bytes_['baseline']:.3f}x "
          f"(target 0.5), decode time {seconds['tied'] / seconds['baseline']:.3f}x "
          f"(target <= 1)")


if __name__ == "__main__":
    main()
