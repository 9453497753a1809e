"""Storage failures (`storage_error`, `files.writing`), and `cem-data tokenize --out gs://...`
when the storage fails, in real processes against the real emulator (`gcs_emulator`), through a
TCP proxy that can hold or cut the emulator's connections: a storage that cannot be reached,
from the start or in the middle of an upload, is one line and exit status 1 within a bounded
time; a SIGINT during an upload is exit status 130 within seconds (the discard of the partial
upload, which the emulator refuses, does not hold it up nor replace the stop), and the same
command then finishes the dataset a straight run makes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from cem_jax import exits
from cem_jax.data import files, shards
from cem_jax.data.storage_errors import storage_error

CEM_DATA = str(Path(sys.executable).parent / "cem-data")
WORDS = "the king queen lord lady sword crown night day love death honour fool wit".split()
UPLOAD_CHUNK = re.compile(rb"(?:POST|PUT) \S*upload_id=")  # a chunk of a resumable upload
REQUEST_LINE = re.compile(rb"[A-Z]+ \S+ HTTP/1\.1\r\n")


class Proxy:
    """127.0.0.1:port to the emulator at `target` (its URL), byte for byte both ways. The first
    request that uploads a chunk of a resumable upload sets `uploading`, then, with `cut`, ends
    the proxy instead of going on (its connections reset, its port refusing: the storage gone in
    the middle of an upload); else it goes on after `hold` seconds. `requests`: the request
    lines seen."""

    def __init__(self, target: str, hold: float = 0.0, cut: bool = False):
        self.target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self.hold, self.cut = hold, cut
        self.uploading = threading.Event()
        self.requests: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for src, dst, requests in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, requests),
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if requests and (line := REQUEST_LINE.match(data)):
                    self.requests.append(line.group().decode().strip())
                if requests and not self.uploading.is_set() and UPLOAD_CHUNK.match(data):
                    self.uploading.set()
                    if self.cut:
                        self.close()
                        return
                    time.sleep(self.hold)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@pytest.fixture
def corpus(tmp_path, small_tokenizer_path) -> list[str]:
    """The arguments of `cem-data tokenize` (one worker, --out to add) for a corpus of one unit,
    6 MB of text: the tokenizer writes its shard in batches of 4 MB of text, so that after the
    first batch's chunks are uploaded (`_env`) more documents are read, and a stop is seen at
    one of them, its shard's upload given up."""
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, 2000)) + "\n" for _ in range(600)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return [CEM_DATA, "tokenize", "--workers", "1", f"data.corpus={path}",
            f"data.tokenizer={small_tokenizer_path}"]


def _env(storage: str) -> dict[str, str]:
    """The environment of a cem-data that reaches the storage at URL `storage`, without
    credentials (see `gcs_emulator`), uploading in chunks of 256 KiB (the least GCS takes; the
    default, 5 MiB, is about one batch of the corpus)."""
    return {**os.environ, "STORAGE_EMULATOR_HOST": storage, "FSSPEC_GS_TOKEN": "anon",
            "FSSPEC_GS_BLOCK_SIZE": str(1 << 18), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raised(call) -> BaseException:
    try:
        call()
    except BaseException as err:  # what it raised is the point
        return err
    raise AssertionError(f"{call} raised nothing")


async def _get(url: str) -> None:
    async with aiohttp.ClientSession() as session, session.get(url):
        pass


def test_what_a_storage_failure_is(monkeypatch):
    """Real failures, each as it comes: aiohttp's (what gcsfs raises once out of retries) and
    TensorStore's (orbax's arrays) are storage failures, in one line; a connection refused
    outside any storage library, an error caused by none, and a stop are not."""
    dead = f"http://127.0.0.1:{_free_port()}"
    said = storage_error(_raised(lambda: asyncio.run(_get(f"{dead}/b/o"))))
    assert said == (f"object storage unreachable or failing (ClientConnectorError: Cannot "
                    f"connect to host 127.0.0.1:{dead.rsplit(':', 1)[1]} ssl:default [Connect "
                    f"call failed ('127.0.0.1', {dead.rsplit(':', 1)[1]})]): nothing was lost; "
                    f"run the same command again")
    ts = pytest.importorskip("tensorstore")
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", dead)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "anon")
    retries = {"max_retries": 1, "initial_delay": "10ms", "max_delay": "10ms"}
    store = ts.KvStore.open({"driver": "gcs", "bucket": "bkt", "path": "ckpt/",
                             "context": {"gcs_request_retries": retries}}).result()
    err = _raised(lambda: store.read("a").result())
    try:
        raise RuntimeError("could not save the checkpoint") from err  # as a caller wraps it
    except RuntimeError as wrapped:
        said = storage_error(wrapped)
    assert said is not None and said.startswith(
        "object storage unreachable or failing (ValueError: ABORTED: All 1 retry attempts "
        "failed: CURL error Could not connect to server")
    assert "\n" not in said and said.endswith("): nothing was lost; run the same command again")
    bad_name = _raised(lambda: ts.KvStore.open({"driver": "gcs", "bucket": "b"}).result())
    refused = _raised(lambda: socket.create_connection(("127.0.0.1", _free_port())))
    for other in (bad_name, refused, ValueError("not UTF-8"), KeyboardInterrupt(),
                  exits.StoppedBySignal(signal.SIGINT)):
        assert storage_error(other) is None, other


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), exits.StoppedBySignal(signal.SIGINT),
                                  ValueError("a document that is not UTF-8")],
                         ids=["KeyboardInterrupt", "StoppedBySignal", "error"])
def test_writing_gives_up_an_upload_with_what_stopped_it_as_itself(gcs_bucket, stop):
    """An upload under way (a 5 MiB chunk sent) given up: its cancellation, which the emulator
    answers with 501 (gcsfs would retry it for ~35 s), takes files.DISCARD_S at most, and what
    stopped the block is what the caller gets; nothing appears."""
    path = f"{gcs_bucket}/shard.bin"
    with pytest.raises(type(stop)) as raised:
        with files.writing(path) as f:
            f.write(b"\0" * (6 << 20))
            started = time.monotonic()
            raise stop
    assert raised.value is stop
    assert time.monotonic() - started < files.DISCARD_S + 1
    assert not files.exists(path)


def test_a_storage_that_cannot_be_reached_is_one_line_and_status_1(corpus, gcs_emulator,
                                                                    gcs_bucket):
    """Nothing listening from the start (the dataset's manifest cannot be read), and the
    storage gone in the middle of the shard's upload (its connections reset, then refused): one
    line each, naming the URL, exit status 1, within a minute (gcsfs tries a request 6 times,
    ~35 s of back-off in all). The two run at once: the wait is gcsfs's, not the CPU's."""
    proxy = Proxy(gcs_emulator, cut=True)
    runs = {f"{gcs_bucket}/dead": f"http://127.0.0.1:{_free_port()}",  # nothing listens there
            f"{gcs_bucket}/cut": proxy.url}
    start = time.monotonic()
    procs = {out: subprocess.Popen([*corpus, "--out", out], env=_env(storage), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for out, storage in runs.items()}
    try:
        results = {out: (*p.communicate(timeout=90), p.returncode, time.monotonic() - start)
                   for out, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
        proxy.close()
    assert proxy.uploading.is_set()
    for out, failed in ((f"{gcs_bucket}/dead", "manifest.json"),  # the first thing it reads
                        (f"{gcs_bucket}/cut", "documents/00000.bin")):  # the shard uploading
        stdout, stderr, status, seconds = results[out]
        assert status == 1, stderr
        line = re.escape(f"cem-data tokenize: error: object storage unreachable or failing at "
                         f"{out}/{failed} (") + r"\w+Error: .+" + re.escape(
                             "): nothing was lost; run the same command again")
        assert re.fullmatch(line + "\n", stderr), stderr
        assert "Traceback" not in stdout, stdout
        assert seconds < 60, (out, seconds)
    assert files.glob(f"{gcs_bucket}/**") == {}  # the shard given up did not appear


def test_sigint_during_an_upload_is_status_130_within_seconds_and_the_rerun_finishes(
        corpus, gcs_emulator, gcs_bucket, tmp_path):
    """A SIGINT while the shard's first chunk is uploading (held 0.5 s by the proxy): the upload
    finishes, the tokenization stops at the next document, the shard's upload is given up (the
    emulator answers its cancellation with 501, which gcsfs would retry for 35 s: given up
    after 2 s), exit status 130 with one line; the same command, run again, makes the dataset
    a straight run makes."""
    proxy = Proxy(gcs_emulator, hold=0.5)
    out = f"{gcs_bucket}/ds"
    proc = subprocess.Popen([*corpus, "--out", out], env=_env(proxy.url), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proxy.uploading.wait(60), proc.communicate(timeout=60)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - sent
    finally:
        proc.kill()
        proxy.close()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert err.splitlines() == ["cem-data tokenize: interrupted; finished units are kept, and "
                                "the same command resumes at the first unfinished one"]
    assert seconds < 5, seconds
    assert [r for r in proxy.requests if r.startswith("DELETE ") and "upload_id=" in r]
    assert files.glob(f"{out}/**") == {}  # the unit's shard was given up: nothing appeared

    again = subprocess.run([*corpus, "--out", out], env=_env(gcs_emulator), text=True,
                           capture_output=True, timeout=60)
    assert again.returncode == 0, again.stderr
    straight = subprocess.run([*corpus, "--out", str(tmp_path / "straight")],
                              env=_env(gcs_emulator), text=True, capture_output=True,
                              timeout=60)
    assert straight.returncode == 0, straight.stderr
    resumed, whole = shards.read_manifest(out), shards.read_manifest(str(tmp_path / "straight"))
    assert (resumed.identity, resumed.splits) == (whole.identity, whole.splits)
    assert shards.verify(out) == []
