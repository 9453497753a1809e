"""`make train` end to end at a reduced size: default corpus, default CEM config, the printed
validation bits per byte (an estimate from the first 16 batches) is finite and well below an
untrained model's, and a sample follows."""

import math
import re
import subprocess
import sys

import pytest
from train_helpers import REPO

from cem_jax.data import DataConfig, load_tokenizer, load_tokens

pytestmark = pytest.mark.slow  # starts processes (make test-all)


def test_make_train_runs_and_learns(tmp_path):
    args = (f"run.dir={tmp_path} run.steps=40 data.batch_size=8 data.seq_len=64 "
            "optimizer.warmup_steps=5 optimizer.lr=1e-2 run.eval_batches=16 "
            "run.sample_tokens=30 run.progress=false")
    # the interpreter running the tests, with nothing installed: an empty stamp is no target
    result = subprocess.run(["make", "--no-print-directory", "train", f"PYTHON={sys.executable}",
                             "RUNTIME_STAMP=", f"ARGS={args}"],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert "pip install" not in result.stdout
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    match = re.search(r"validation after 40 steps: loss ([\d.]+) nats/token, perplexity "
                      r"([\d.]+), bits per byte \(estimate\) ([\d.]+)", result.stdout)
    assert match, result.stdout[-2000:]
    loss, perplexity, bpb = map(float, match.groups())
    assert math.isfinite(bpb) and abs(perplexity - math.exp(loss)) < 0.01 * perplexity
    stats = load_tokens(DataConfig(), load_tokenizer(tmp_path / "tokenizer.model"),
                        "validation").stats
    untrained = stats.bits_per_byte(math.log(2048))  # uniform prediction over the vocabulary
    assert bpb < untrained - 0.5, (bpb, untrained)
    sample = result.stdout.split("sample:\n", 1)[1]
    assert sample.startswith("ROMEO:") and len(sample.strip()) > len("ROMEO:")
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "metrics.jsonl").is_file()
