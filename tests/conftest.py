"""Shared test settings: hypothesis profile sized for a 2-core CPU machine; a local GCS emulator
for tests of gs:// (`gcs_bucket`)."""

import json
import logging
import os
import socket
import urllib.request
import uuid

import pytest
from hypothesis import settings

settings.register_profile("cem", max_examples=5, deadline=None, derandomize=True)
settings.load_profile("cem")

# Read when gcsfs is imported. gcsfs >= 2026.x otherwise asks the Storage Control gRPC API,
# which no emulator serves, for each bucket's type (a 60 s timeout, retried). Set for the whole
# session, so that subprocesses inherit it too.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_gcsfs() -> None:
    """Drop cached gcsfs instances, so the next one is made with the environment of now."""
    import gcsfs

    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        raise RuntimeError("gcsfs was imported before tests/conftest.py set "
                           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: its experimental file "
                           "system would wait a minute per bucket on the emulator")
    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def gcs_emulator():
    """The URL of a GCS emulator (`gcp-storage-emulator`, in memory, in this process) on
    127.0.0.1, for the session, with fsspec/gcsfs and array_record pointed at it.

    While it runs, os.environ holds what a subprocess (cem-train reading gs://) needs to use it:
      STORAGE_EMULATOR_HOST=URL               gcsfs (and google-cloud-storage)
      FSSPEC_GS_TOKEN=anon                    gcsfs without credentials (read at fsspec import)
      CLOUD_STORAGE_EMULATOR_ENDPOINT=URL     google-cloud-cpp inside array_record
      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (set at this conftest's import, for the session)
    In this process fsspec's configuration gets token "anon" for gs; all is restored after.
    """
    import fsspec.config
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    env = {"STORAGE_EMULATOR_HOST": url, "FSSPEC_GS_TOKEN": "anon",
           "CLOUD_STORAGE_EMULATOR_ENDPOINT": url}
    saved_env = {key: os.environ.get(key) for key in env}
    saved_conf = fsspec.config.conf.get("gs")
    os.environ.update(env)
    fsspec.config.conf["gs"] = {**(saved_conf or {}), "token": "anon"}
    _fresh_gcsfs()
    try:
        yield url
    finally:
        server.stop()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if saved_conf is None:
            fsspec.config.conf.pop("gs", None)
        else:
            fsspec.config.conf["gs"] = saved_conf
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
