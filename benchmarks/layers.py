"""Benchmark of the CEM core on CPU (issue #2). Prints times and ratios measured in one run.

1. One CEM attention sub-layer, forward+backward, `xla` (closed form) vs `autodiff`
   (-jax.grad of the energy) at B=8, T=512, D=512, H=8. Target: xla ≤ 0.7× autodiff.
2. A 4-layer D=256 model, forward+backward of the loss: fully tied CEM vs the untied Llama
   baseline (same D, L, H, F). Target: tied not slower (ratio ≤ 1).

Run: `python benchmarks/layers.py` (or `make bench`).
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from timing import median_times

from cem_jax.config import ModelConfig
from cem_jax.energies import AttentionSpec
from cem_jax.layers import run_steps
from cem_jax.model import CEMTransformer
from cem_jax.updates import tied_attention_mixer


def attention_sublayer(B=8, T=512, D=512, H=8):
    K = D // H
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"query": 0.02 * jax.random.normal(keys[0], (D, H, K)),
              "key": 0.02 * jax.random.normal(keys[1], (D, H, K))}
    x = jax.random.normal(keys[2], (B, T, D))
    spec = AttentionSpec(H, H, K, use_rope=True)

    def make(impl):
        def loss(params, x):
            mixer = tied_attention_mixer(params, spec, None, None)
            out, _, _ = run_steps(x, mixer, norm_scale=jnp.ones(D), eps=1e-5,
                                  precond=lambda u: u, impl=impl)
            return jnp.sum(out**2)

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return lambda: step(params, x)

    t = median_times({"xla": make("xla"), "autodiff": make("autodiff")})
    print(f"CEM attention sub-layer fwd+bwd B={B} T={T} D={D} H={H}: "
          f"xla {t['xla'] * 1e3:.1f} ms, autodiff {t['autodiff'] * 1e3:.1f} ms, "
          f"ratio xla/autodiff {t['xla'] / t['autodiff']:.2f} (target ≤ 0.70)")


def model_step(B=8, T=256):
    base = dict(vocab_size=2048, d_model=256, num_layers=4, num_heads=4, mlp_dim=704)
    configs = {"cem": ModelConfig(**base),
               "llama": ModelConfig(**base, tie_attention=False, tie_mlp=False,
                                    preconditioner="none")}
    tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T + 1), 0, 2048)
    fns = {}
    for name, cfg in configs.items():
        graphdef, params = nnx.split(CEMTransformer(cfg, rngs=nnx.Rngs(0)))

        def loss(params, graphdef=graphdef):
            logits = nnx.merge(graphdef, params)(tokens[:, :-1]).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        step = jax.jit(jax.grad(loss))
        fns[name] = lambda step=step, params=params: step(params)
    t = median_times(fns)
    print(f"4-layer D=256 model fwd+bwd B={B} T={T}: tied CEM {t['cem'] * 1e3:.1f} ms, "
          f"Llama {t['llama'] * 1e3:.1f} ms, ratio CEM/Llama {t['cem'] / t['llama']:.2f} "
          "(target ≤ 1.00)")


if __name__ == "__main__":
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    attention_sublayer()
    model_step()
