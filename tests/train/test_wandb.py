"""`run.wandb_project`: the records of metrics.jsonl, the config and the run's identity go to
Weights & Biases: what is sent, through a stand-in for the `wandb` module; and an offline run of
the real one, read back from its `.wandb` file. Nothing here reaches the network."""

import json
import struct
import sys
import types
from pathlib import Path

import faults
import pytest
import yaml

from cem_jax.cli.train import main
from cem_jax.train import load_config, train
from cem_jax.train.metrics import MetricsWriter, logged_records


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"),
                        ("WANDB_ERROR_REPORTING", "false"), ("WANDB_DISABLE_GIT", "true")):
        monkeypatch.setenv(name, value)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))


class FakeWandb(types.ModuleType):
    """A stand-in for `wandb`: records `init`'s keywords, each run's `log(data, step=)` calls
    and the exit codes of `finish`."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.exit_codes = [], [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        logs = []
        self.logs.append(logs)
        return types.SimpleNamespace(log=lambda data, step: logs.append((step, data)),
                                     finish=lambda exit_code: self.exit_codes.append(exit_code))


def _sent(records: list[dict]) -> list[tuple[int, dict]]:
    """What W&B should get for these metrics.jsonl records: (step, {"kind/name": value})."""
    return [(r["step"], {f"{r['kind']}/{k}": v for k, v in r.items()
                         if k not in ("step", "kind", "time")}) for r in records]


@pytest.mark.slow
def test_wandb_gets_the_records_the_config_and_the_resume_identity(tiny_overrides, tmp_path,
                                                                   monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = [*tiny_overrides, f"run.dir={tmp_path}", "run.sample_tokens=0", "run.eval_every=3",
            "run.wandb_project=cem", "run.wandb_entity=lab"]
    train(load_config(None, [*args, "run.steps=6"]))
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert fake.inits == [{"project": "cem", "entity": "lab", "mode": "online", "dir": tmp_path,
                           "id": run_id, "name": tmp_path.name, "resume": "allow",
                           "config": yaml.safe_load((tmp_path / "config.yaml").read_text())}]
    first = logged_records(tmp_path)
    assert {r["kind"] for r in first} == {"train", "eval", "goodput"}
    assert fake.logs == [_sent(first)] and fake.exit_codes == [0]

    train(load_config(None, [*args, "run.steps=9"]))  # resumed from its checkpoint of step 6
    assert fake.inits[1]["id"] == run_id and fake.inits[1]["resume"] == "allow"
    resumed = logged_records(tmp_path)[len(first):]
    assert [r["step"] for r in resumed if r["kind"] == "train"] == [7, 8, 9]
    assert fake.logs[1] == _sent(resumed) and fake.exit_codes == [0, 0]


@pytest.mark.slow
def test_a_failed_run_finishes_as_failed_and_a_start_over_is_a_new_wandb_run(
        tiny_overrides, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = [*tiny_overrides, f"run.dir={tmp_path}", "run.sample_tokens=0", "run.steps=3",
            "run.wandb_project=cem"]
    with monkeypatch.context() as patch:
        faults.arm(patch.setattr, nan_step=2)
        assert main(args) == 3  # diverged before any checkpoint
    assert fake.exit_codes == [1]
    assert [step for step, values in fake.logs[0] if "train/loss" in values] == [1]
    assert main(args) == 0  # starts over from step 0: a new W&B run
    assert fake.inits[1]["id"] != fake.inits[0]["id"]
    assert (tmp_path / "wandb_run_id").read_text() == fake.inits[1]["id"]
    assert fake.exit_codes == [1, 0]


def test_a_refused_login_is_one_line_and_cannot_run(tiny_overrides, tmp_path, monkeypatch,
                                                   capsys):
    fake = FakeWandb()

    class UsageError(Exception):
        pass

    def refuse(**kwargs):
        raise UsageError("No API key configured. Use `wandb login` to log in.")

    fake.errors = types.SimpleNamespace(UsageError=UsageError, AuthenticationError=UsageError)
    fake.init = refuse
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert main([*tiny_overrides, f"run.dir={tmp_path / 'run'}", "run.steps=2",
                 "run.wandb_project=cem"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "cem-train: error: W&B cannot start (run.wandb_mode = 'online'): No API key "
        "configured. Use `wandb login` to log in; log in (wandb login, or WANDB_API_KEY), or "
        "set run.wandb_mode=offline (exit status 2)"]
    assert not (tmp_path / "run").exists()


def test_a_wandb_mode_other_than_online_or_offline_is_refused():
    with pytest.raises(ValueError, match="'run.wandb_mode' = 'disabled'.*'online', 'offline'"):
        load_config(None, ["run.wandb_mode=disabled"])


def test_without_wandb_installed_the_run_cannot_start(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.wandb_project=cem"])
    with pytest.raises(ValueError, match=r"needs wandb: pip install 'cem_jax\[wandb\]'"):
        MetricsWriter(tmp_path, 0, cfg)
    assert not (tmp_path / "wandb_run_id").exists()


def _wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file (a LevelDB-style log: a 7-byte header, then
    32 KiB blocks of chunks, each crc32, length, type (1 whole, 2 first, 3 middle, 4 last))."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            records.append(Record.FromString(parts))
            parts = b""
    return records


@pytest.mark.slow
def test_an_offline_wandb_run_holds_the_logged_losses_and_the_config(tiny_overrides, tmp_path):
    import wandb  # a dev extra: installed by `make test`

    try:
        train(load_config(None, [*tiny_overrides, f"run.dir={tmp_path}", "run.steps=4",
                                 "run.sample_tokens=0", "run.wandb_project=cem",
                                 "run.wandb_mode=offline"]))
    finally:
        wandb.teardown()  # the wandb-core service process
    run_id = (tmp_path / "wandb_run_id").read_text()
    offline, = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    records = _wandb_records(offline / f"run-{run_id}.wandb")
    run, = [r.run for r in records if r.HasField("run")]
    assert run.run_id == run_id and run.project == "cem" and run.display_name == tmp_path.name
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["run"]["wandb_mode"] == "offline" and config["model"]["d_model"] == 32
    rows = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            for r in records if r.HasField("history")]
    losses = {row["_step"]: row["train/loss"] for row in rows}
    assert losses == {r["step"]: r["loss"] for r in logged_records(tmp_path)
                      if r["kind"] == "train"}
    assert len(losses) == 4
