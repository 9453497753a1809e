"""Sizes that cannot fit are refused in one line before anything is allocated or written: a
decode cache larger than the memory there is (cem-sample), a model whose train step cannot fit
(cem-train); a temperature that is not a number is refused too."""

from __future__ import annotations

import math

import numpy as np
import pytest
from decode_helpers import tiny_config
from helpers import random_params

from cem_jax.cli.sample import main as sample_main
from cem_jax.data import train_tokenizer
from cem_jax.memory import DoesNotFit, device_memory_bytes
from cem_jax.rundir import write_run
from cem_jax.sample import SamplingConfig, generate
from cem_jax.train_config import config_from_dict


def test_the_memory_of_this_cpu_device_is_known():
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable"))
    assert device_memory_bytes() == pytest.approx(available, rel=0.2)


def test_a_decode_cache_larger_than_memory_is_refused():
    cfg = tiny_config()
    with pytest.raises(DoesNotFit, match=r"decoding 1 prompt\(s\) of up to 2 tokens and "
                       r"1,000,000,000 new ones \(its cache\) needs at least [\d,.]+ GB, more "
                       r"than the [\d,.]+ GB of memory there is \(cpu device 0\); lower"):
        generate(random_params(cfg), cfg, [[3, 5]], SamplingConfig(max_new_tokens=10**9))


def test_cem_sample_refuses_absurd_sizes_and_a_nan_temperature(tmp_path, capsys):
    rng = np.random.default_rng(0)
    text = " ".join("".join(rng.choice(list("abcdefghij"), 4)) for _ in range(2000))
    tokenizer = train_tokenizer([text], 320)
    values = {"model": {"vocab_size": 320, "d_model": 16, "num_layers": 1, "num_heads": 2,
                        "mlp_dim": 32},
              "data": {"vocab_size": 320}, "run": {"dir": str(tmp_path / "run"), "steps": 1}}
    write_run(tmp_path / "run", config_from_dict(values),
              random_params(config_from_dict(values).model), tokenizer)
    assert sample_main(["--run", str(tmp_path / "run"), "--max-new-tokens", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more than the" in err and "--max-new-tokens" in err
    assert sample_main(["--run", str(tmp_path / "run"), "--temperature", "nan"]) == 2
    assert "temperature = nan must be a finite number >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="finite"):
        SamplingConfig(temperature=math.inf)
