"""A storage outage in the middle of a run on a bucket (`run.dir=gs://...`): cem-train reaches
the emulator (`gcs_bucket`) through a TCP proxy in this process, which the test cuts at a chosen
point (`tests/faults.py`'s pause, once checkpoint 2 is committed and before the next save
starts). The run fails at the metrics flush that precedes its next save: exit status 75 (the
launchers relaunch it), one line on stderr, within a bounded time (no full retry cycle at each
cleanup on the way out); checkpoint 2 still restores; once the storage is back, the same command
resumes from it at once (the lock left on the bucket is its dead holder's, on this host) and
finishes. Also: which lock holders a relaunch takes over at once (`cem_jax.train.lock._gone`),
and cem-eval, cem-sample and cem-export meeting a storage failure (one line, status 1)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from faults import fault_env
from train_helpers import REPO, run_cli

from cem_jax.checkpoint import COMMIT_MARKER, complete_steps
from cem_jax.data import files
from cem_jax.rundir import load_run

STEPS = 6
MAX_FAIL_S = 120  # from the cut to the process's end
# TensorStore's log (stderr, at its first request) of the emulator's credentials (`gcs_emulator`:
# GOOGLE_AUTH_TOKEN_FOR_TESTING), which no real bucket's run prints
TEST_TOKEN_LOG = re.compile(r"I\d{4} [\d:. ]+\d+ google_auth_provider\.cc:\d+\] Using "
                            r"GOOGLE_AUTH_TOKEN_FOR_TESTING$")


class Proxy:
    """127.0.0.1:`port` to the emulator at `target` (its URL), byte for byte both ways (a thread
    per direction of each connection). `cut()`: the storage gone (the listener closed, every
    open connection reset: new ones are refused); `restore()`: it listens again on the same
    port."""

    def __init__(self, target: str):
        self.target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._serve()

    def _serve(self) -> None:
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                if listener.fileno() == -1:  # cut meanwhile
                    client.close()
                    upstream.close()
                    return
                self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            for s in [self.listener, *self.sockets]:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self.sockets = []

    def restore(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR
        self._serve()


def _wait_for(path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"cem-train ended ({proc.returncode}) before its pause:\n"
                                 f"{out[-2000:]}\n{err[-3000:]}")
        assert time.monotonic() < deadline, "cem-train did not reach its pause"
        time.sleep(0.1)


def _cut_at_pause(args: list[str], env: dict[str, str], proxy: Proxy, paused,
                  before_cut=lambda: None) -> tuple[int, str, str, float]:
    """Start `cem-train ARGS` (environment `env`, which pauses it with file `paused`), wait for
    its pause, call `before_cut()`, cut `proxy` and let it go on; returns (exit status, stdout,
    stderr, seconds from the cut to its end). The proxy stays cut."""
    proc = subprocess.Popen([sys.executable, "-m", "cem_jax.cli.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(paused, proc, timeout=240)
        before_cut()
        proxy.cut()
        cut = time.monotonic()
        paused.unlink()
        out, err = proc.communicate(timeout=300)
        took = time.monotonic() - cut
    finally:
        proc.kill()
        proxy.cut()
    return proc.returncode, out, err, took


def test_a_storage_outage_before_a_save_is_one_line_status_75_and_the_run_resumes(
        tiny_overrides, gcs_emulator, gcs_bucket, tmp_path):
    """The storage cut after step 3 (checkpoint 2 committed): the run fails at step 4's metrics
    flush, before its save, with exit status 75 and one line on stderr naming the URL, in
    bounded time; checkpoint 2 restores; the same command, the storage back, resumes from step
    2 at once and finishes."""
    run_dir = f"{gcs_bucket}/runs/cem"
    proxy = Proxy(gcs_emulator)
    through_proxy = {"STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}
    paused = tmp_path / "paused"
    args = [*tiny_overrides, f"run.steps={STEPS}", "run.checkpoint_every=2",
            f"run.dir={run_dir}", "run.sample_tokens=0", "imports=[faults]"]
    env = {**os.environ, **fault_env(pause_step=3, pause_file=paused), **through_proxy}
    checkpoints = files.join(run_dir, "checkpoints")

    def committed() -> None:
        assert complete_steps(checkpoints) == [2]
        assert files.is_file(files.join(checkpoints, "2", COMMIT_MARKER))

    returncode, out, err, took = _cut_at_pause(args, env, proxy, paused, committed)
    print(f"from the cut to the end of cem-train: {took:.1f} s\nstdout (its end):\n"
          f"{out[-1500:]}\nstderr:\n{err}")
    assert returncode == 75, (out[-2000:], err[-3000:])  # the launchers relaunch it
    lines = [line for line in err.splitlines() if not TEST_TOKEN_LOG.match(line)]
    assert len(lines) == 1, err[-5000:]
    assert lines[0].startswith(f"cem-train: the training process, during the metrics flush "
                               f"before the checkpoint of step 4: object storage unreachable "
                               f"or failing at {run_dir}/"), lines
    assert "nothing was lost" in lines[0] and lines[0].endswith("(exit status 75)"), lines
    assert took < MAX_FAIL_S, took

    proxy.restore()
    assert complete_steps(checkpoints) == [2]  # step 4's save never started
    run = load_run(run_dir)
    assert run.step == 2 and run.config.run.steps == STEPS
    started = time.monotonic()
    resumed = run_cli(args, env={**fault_env(), **through_proxy})
    assert resumed.returncode == 0, (resumed.stdout[-2000:], resumed.stderr[-3000:])
    assert "from step 2" in resumed.stdout, resumed.stdout[-3000:]
    assert "taking over the lock" in resumed.stdout, resumed.stdout[-3000:]
    print(f"the resumed run took {time.monotonic() - started:.1f} s")
    assert complete_steps(checkpoints) == [2, 4, 6]
    assert not [n for n in files.names(run_dir) if n.startswith(".lock")]


def test_a_storage_outage_during_a_data_read_is_one_line_status_75_and_the_run_resumes(
        tiny_overrides, gcs_emulator, gcs_bucket, tmp_path):
    """The tokenized data on the bucket (`data.cache_dir=gs://...`), the run directory local:
    the storage cut after step 3, the next batch's reads fail (once the batches read ahead are
    used), and the run ends with status 75 and one line naming the data's URL, in bounded time;
    the storage back, the same command resumes from checkpoint 2 and finishes."""
    proxy = Proxy(gcs_emulator)
    through_proxy = {"STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}
    paused, cache = tmp_path / "paused", f"{gcs_bucket}/cache"
    args = [*(o for o in tiny_overrides if not o.startswith("data.cache_dir=")),
            f"data.cache_dir={cache}", "run.steps=60", "run.checkpoint_every=2",
            "run.eval_every=1000", f"run.dir={tmp_path / 'run'}", "run.sample_tokens=0",
            "imports=[faults]"]
    env = {**os.environ, **fault_env(pause_step=3, pause_file=paused), **through_proxy}
    returncode, out, err, took = _cut_at_pause(args, env, proxy, paused)
    assert returncode == 75, (out[-2000:], err[-3000:])
    lines = [line for line in err.splitlines() if not TEST_TOKEN_LOG.match(line)]
    assert len(lines) == 1, err[-5000:]
    assert re.fullmatch(rf"cem-train: the training process, during train step \d+: object "
                        rf"storage unreachable or failing at {cache}/.*\(exit status 75\)",
                        lines[0]), lines
    assert took < MAX_FAIL_S, took
    proxy.restore()
    resumed = run_cli(args, env={**fault_env(), **through_proxy})
    assert resumed.returncode == 0, (resumed.stdout[-2000:], resumed.stderr[-3000:])
    assert "resumed" in resumed.stdout and "from step " in resumed.stdout


def test_a_save_in_flight_when_its_storage_goes_is_abandoned_in_bounded_time(
        tiny_overrides, gcs_emulator, gcs_bucket, tmp_path):
    """TensorStore's writes (the checkpoint's arrays, through their own proxy) cut after step 3,
    gcsfs's (metrics, orbax's folders) left: the save of step 4 starts and its arrays cannot be
    written (TensorStore would retry for many minutes). It is abandoned after
    run.save_timeout_s, in one line, status 75; its temporary folder is never restored: the
    relaunch, the storage back, resumes from step 2 and finishes."""
    run_dir = f"{gcs_bucket}/runs/cem"
    arrays = Proxy(gcs_emulator)
    through = {"STORAGE_EMULATOR_HOST": gcs_emulator, "TENSORSTORE_GCS_HTTP_URL": arrays.url}
    paused = tmp_path / "paused"
    args = [*tiny_overrides, f"run.steps={STEPS}", "run.checkpoint_every=2",
            f"run.dir={run_dir}", "run.sample_tokens=0", "run.save_timeout_s=5",
            "imports=[faults]"]
    env = {**os.environ, **fault_env(pause_step=3, pause_file=paused), **through}
    returncode, out, err, took = _cut_at_pause(args, env, arrays, paused)
    lines = [line for line in err.splitlines() if not TEST_TOKEN_LOG.match(line)]
    assert returncode == 75 and len(lines) == 1, err[-5000:]
    assert lines[0].startswith("cem-train: the training process abandoned the checkpoint save "
                               "of step 4, unfinished after "), lines
    assert lines[0].endswith("the newest complete checkpoint is step 2: relaunch to resume "
                             "from it (exit status 75)"), lines
    assert 5 <= took < 30, took
    checkpoints = files.join(run_dir, "checkpoints")
    assert complete_steps(checkpoints) == [2]
    arrays.restore()
    resumed = run_cli(args, env={**fault_env(), **through})
    assert resumed.returncode == 0, (resumed.stdout[-2000:], resumed.stderr[-3000:])
    assert "from step 2" in resumed.stdout, resumed.stdout[-3000:]
    assert complete_steps(checkpoints) == [2, 4, 6]


def test_a_lock_left_by_a_process_gone_from_this_host_is_taken_over_at_once(gcs_bucket):
    """A bucket lock refreshed just now is taken over at once only when it names a process of
    this host (and pid namespace) that no longer runs; a live process's, another host's, an
    older lock's words (no pid namespace) and this process's own are refused."""
    from cem_jax.train import lock

    run_dir = f"{gcs_bucket}/runs/left"
    first = files.join(run_dir, ".lock.1")
    here = lock._place()
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        held = [f"pid {alive.pid} on {here}, token 0a", f"pid {gone} on another-host, token 0a",
                f"pid {os.getpid()} on {here}, token 0a"]
        if here != socket.gethostname():  # Linux: a lock naming the host alone
            held.append(f"pid {gone} on {socket.gethostname()}, token 0a")
        for holder in held:
            files.write_text(first, holder)
            with pytest.raises(lock.RunDirInUse, match="lapses"):
                with lock.run_dir_lock(run_dir, lead=True):
                    pass
    finally:
        alive.kill()
        alive.wait()
    files.write_text(first, f"pid {gone} on {here}, token 0a")
    with lock.run_dir_lock(run_dir, lead=True):
        assert [n for n in files.names(run_dir) if n.startswith(".lock")] == [".lock.2"]
        assert files.read_text(files.join(run_dir, ".lock.2")).startswith(
            f"pid {os.getpid()} on {here}, token ")
    assert [n for n in files.names(run_dir) if n.startswith(".lock")] == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _storage_failures(monkeypatch) -> dict[str, Exception]:
    """Real storage failures, raised at once (no retries), as the commands meet them: gcsfs's
    out of retries (aiohttp's ClientConnectorError, noted with its URL by `files`) and an orbax
    restore that TensorStore could not read (a CheckpointError caused by its ValueError)."""
    import aiohttp
    import tensorstore as ts

    from cem_jax.checkpoint import restore_error

    dead = f"http://127.0.0.1:{_free_port()}"

    async def get() -> None:
        async with aiohttp.ClientSession() as session, session.get(f"{dead}/b/o"):
            pass

    try:
        asyncio.run(get())
    except aiohttp.ClientError as err:
        err.add_note("storage URL: gs://bkt/runs/cem/config.yaml")
        gcsfs_failure: Exception = err
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", dead)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "anon")
    store = ts.KvStore.open({"driver": "gcs", "bucket": "bkt", "path": "runs/cem/checkpoints/",
                             "context": {"gcs_request_retries": {
                                 "max_retries": 1, "initial_delay": "10ms",
                                 "max_delay": "10ms"}}}).result()
    try:
        store.read("2/state/manifest.ocdbt").result()
    except ValueError as err:
        restore_failure = restore_error("gs://bkt/runs/cem/checkpoints/2", err)
        restore_failure.__cause__ = err
    return {"gcsfs": gcsfs_failure, "tensorstore": restore_failure}


@pytest.mark.parametrize("command", ["cem-eval", "cem-sample", "cem-export"])
@pytest.mark.parametrize("kind", ["gcsfs", "tensorstore"])
def test_a_storage_failure_is_one_line_and_status_1_in_the_other_commands(
        command, kind, monkeypatch, capsys, tmp_path):
    """cem-eval, cem-sample and cem-export meeting a storage that cannot be reached where they
    first read the run (its tokenizer, config or checkpoint): one line on stderr, status 1, no
    traceback."""
    import logging

    import cem_jax.data
    import cem_jax.rundir
    from cem_jax.cli import evaluate, sample
    from cem_jax.cli import export as cli

    failure = _storage_failures(monkeypatch)[kind]

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(cem_jax.rundir, "load_run", fail)
    monkeypatch.setattr(cem_jax.rundir, "check_run_dir", fail)  # cem-export's first read
    monkeypatch.setattr(cem_jax.data, "find_tokenizer", fail)
    absl = logging.getLogger("absl")
    monkeypatch.setattr(absl, "level", absl.level)  # the commands quieten it
    main, extra = {"cem-eval": (evaluate.main, []), "cem-sample": (sample.main, []),
                   "cem-export": (cli.main, ["--format", "safetensors", "--out",
                                             str(tmp_path / "out")])}[command]
    assert main(["--run", "gs://bkt/runs/cem", *extra]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"{command}: error: object storage unreachable or failing at "
                          f"gs://bkt/runs/cem/"), err
    assert err.rstrip().endswith("nothing was lost; run the same command again"), err


def test_a_process_that_leaves_for_a_lost_peer_releases_its_bucket_lock(gcs_bucket):
    """`watchdog.leave` (a lost peer: no unwinding, status 75) still deletes the run
    directory's lock object, so a relaunch on another host takes the run at once instead of
    waiting out the lease."""
    run_dir = f"{gcs_bucket}/runs/left"
    code = (f"from cem_jax.train import lock, watchdog; watchdog.started(0, 2)\n"
            f"with lock.run_dir_lock({run_dir!r}, lead=True):\n"
            f"    print(*lock._locks({run_dir!r}), flush=True)\n"
            f"    watchdog.leave('lost a peer (a test)')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 75, result.stderr
    assert result.stdout.startswith("(1, ") and "/runs/left/.lock.1" in result.stdout
    assert result.stderr.splitlines()[-1].startswith("cem-train: process 0 of 2 lost a peer")
    assert [n for n in files.names(run_dir) if n.startswith(".lock")] == []


def test_a_training_process_killed_holding_the_bucket_lock_has_it_deleted(
        tiny_overrides, gcs_bucket, tmp_path):
    """SIGKILL of cem-train's training process (the out-of-memory killer) skips every release:
    its supervisor, which saw it die holding the lock object, deletes it, so that a relaunch on
    another host does not wait out the lease."""
    run_dir, paused = f"{gcs_bucket}/runs/killed", tmp_path / "paused"
    args = [*tiny_overrides, f"run.steps={STEPS}", f"run.dir={run_dir}", "run.sample_tokens=0",
            "imports=[faults]"]
    env = {**os.environ, **fault_env(pause_step=2, pause_file=paused)}
    proc = subprocess.Popen([sys.executable, "-m", "cem_jax.cli.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(paused, proc, timeout=240)
        assert [n for n in files.names(run_dir) if n.startswith(".lock")] == [".lock.1"]
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as children:
            os.kill(int(children.read().split()[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "died of SIGKILL" in err, err[-3000:]
    assert [n for n in files.names(run_dir) if n.startswith(".lock")] == []
