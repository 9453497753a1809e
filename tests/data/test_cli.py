"""`cem-data fetch|tokenize|inspect` on the real corpus and on a user corpus; the data section
from `--config` with `data.key=value` overrides."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from cem_jax.cli.data import main
from cem_jax.data import HELD_OUT_WORKS, load_tokenizer
from cem_jax.data.shakespeare import ARCHIVE_SHA256


def test_fetch_lists_the_split(archive_cache, capsys):
    assert main(["fetch", "--cache-dir", str(archive_cache)]) == 0
    out = capsys.readouterr().out
    assert ARCHIVE_SHA256 in out and "42 works, 5,057,198 characters" in out
    assert "training: 39 works, 4,811,718 characters" in out
    assert all(work in out for work in HELD_OUT_WORKS) and "(4.85%)" in out
    assert "paradise_lost" in out


def test_inspect_shows_counts_held_out_works_and_a_decoded_batch(archive_cache, capsys):
    args = ["inspect", "--cache-dir", str(archive_cache), "--seq-len", "64", "--rows", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for line_start in ("train  ", "validation  ", "milton  "):
        assert any(line.startswith(line_start) for line in out.splitlines()), line_start
    assert "held out for validation: julius_caesar (116,216)" in out
    assert "inputs int32[32, 64]" in out
    assert out.count("=== row ") == 3 and "--- segment 1: " in out


def test_data_section_of_a_config_with_overrides_then_options(small_cfg, tmp_path, capsys):
    data = dataclasses.asdict(small_cfg(seq_len=512, batch_size=3))
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"model": {"d_model": 8}, "data": data}))
    (tmp_path / "run.yaml").write_text("base: base.yaml\ndata: {seq_len: 16}\n")
    args = ["inspect", "--config", str(tmp_path / "run.yaml"), "data.seq_len=24",
            "data.batch_size=2", "--batch-size", "5", "--rows", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "inputs int32[5, 24]" in out and data["val_corpus"] in out
    assert main(["inspect", "--config", str(tmp_path / "run.yaml"), "model.d_model=4"]) == 2
    assert capsys.readouterr().err == ("cem-data inspect: error: override 'model.d_model=4' is "
                                       "not in section 'data', the only one read here\n")


def test_tokenize_a_user_corpus_and_save_the_tokenizer(tmp_path, capsys):
    words = "to be or not that is the question whether tis nobler in mind suffer".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=300)) + "\n" for _ in range(40)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    out_model = tmp_path / "run" / "tokenizer.model"
    args = ["tokenize", "--corpus", str(corpus), "--vocab-size", "320", "--cache-dir",
            str(tmp_path / "cache"), "--save-tokenizer", str(out_model)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert load_tokenizer(out_model).vocab_size == 320
    train = next(line for line in out.splitlines() if line.startswith("train ")).split()
    assert train[1:3] == ["40", f"{sum(map(len, texts)):,}"] and "jsonl" in train
    assert out.count("(1 file)") == 1 and "files)" not in out  # one corpus file, said once
    assert "validation (none: " in out and "milton" not in out
    plain = tmp_path / "plain"  # --out: a dataset that a run names, and how
    assert main([*args[:-2], "--out", str(plain)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"train with data.corpus={plain}")
    held = tmp_path / "held"
    assert main([*args[:-2], "--val-fraction", "0.1", "--out", str(held)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        f"train with data.corpus={held} data.val_fraction=0.1")  # what a run must say too


def test_a_tokenizer_to_train_takes_the_model_vocabulary_of_the_config(tmp_path, capsys):
    """data.vocab_size null: the size is the config's model.vocab_size, as in cem-train."""
    (tmp_path / "a.txt").write_text("to be or not to be, that is the question\n" * 200)
    (tmp_path / "run.yaml").write_text("model: {vocab_size: 300}\n")
    args = ["tokenize", "--config", str(tmp_path / "run.yaml"), "--corpus",
            str(tmp_path / "a.txt"), "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    assert "tokenizer: sentencepiece, vocab 300, " in capsys.readouterr().out


def test_tokenize_with_a_tokenizer_json_saves_it_with_its_special_tokens(
        small_cfg, small_hf_tokenizer_path, tmp_path, capsys):
    cfg = small_cfg()
    saved = tmp_path / "run" / "tokenizer.json"
    args = ["tokenize", "--corpus", cfg.corpus, "--val-corpus", cfg.val_corpus, "--cache-dir",
            cfg.cache_dir, "--tokenizer", str(small_hf_tokenizer_path), "--save-tokenizer",
            str(saved)]
    assert main(args) == 0
    assert "tokenizer: huggingface, vocab 400, " in capsys.readouterr().out
    assert sorted(p.name for p in saved.parent.iterdir()) == ["tokenizer.json",
                                                              "tokenizer_config.json"]
    loaded, original = load_tokenizer(saved), load_tokenizer(small_hf_tokenizer_path)
    assert (loaded.sha256, loaded.eos_id, loaded.pad_id) == (original.sha256, 0, 1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer_config.json").write_text("{}")  # the user's: kept
    assert main([*args[:-1], str(tmp_path / "other" / "tokenizer.json")]) == 2
    assert capsys.readouterr().err == (
        f"cem-data tokenize: error: {tmp_path / 'other' / 'tokenizer_config.json'} exists (a "
        f"run's tokenizer must match its checkpoints): choose a new --save-tokenizer path\n")
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["tokenizer_config.json"]


def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"abc\xfe")
    assert main(["tokenize", "--corpus", str(tmp_path / "bad.txt"), "--cache-dir",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cem-data tokenize: error: ") and "byte offset 3" in err
    assert main(["inspect", "--seq-len", "0"]) == 2
    assert "'seq_len' = 0 is invalid" in capsys.readouterr().err
    assert main(["inspect", "data.seq_len=1"]) == 2
    assert "config field 'data.seq_len' = 1 is invalid" in capsys.readouterr().err
    assert main(["inspect", "data.seq_lenn=1"]) == 2
    assert "did you mean 'seq_len'" in capsys.readouterr().err


@pytest.mark.parametrize("cache_dir", ["cache", "cache/sub"])
@pytest.mark.parametrize("command", ["fetch", "tokenize"])
def test_a_cache_dir_in_a_file_is_a_clear_error(tmp_path, capsys, command, cache_dir):
    (tmp_path / "cache").write_text("a file\n")
    (tmp_path / "a.txt").write_text("some text\n")
    assert main([command, "--cache-dir", str(tmp_path / cache_dir), "--corpus",
                 str(tmp_path / "a.txt")]) == 2
    assert capsys.readouterr().err == (
        f"cem-data {command}: error: the cache directory {tmp_path / cache_dir} cannot be used: "
        f"{tmp_path / 'cache'} is a file; set data.cache_dir (cem-data --cache-dir) or "
        f"$CEM_JAX_CACHE to a directory\n")


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "cem-data"
    assert script.is_file(), "run `pip install -e .` to install the cem-data entry point"
    result = subprocess.run([str(script), "fetch", "--help"], capture_output=True, text=True,
                            timeout=60, check=True)
    assert "--shakespeare-archive" in result.stdout and "--allow-invalid-utf8" in result.stdout
