import gc
import os
import tempfile

# Tests run on the CPU with 8 fake devices, so sharding can be checked; must be set before jax imports.
# Most of the suite compiles small programs and runs them a few steps, so it compiles fast:
# - LLVM at -O1, not -O3. Measured on 2 cores: test_train.py's end-to-end tests 109 -> 85 s; the whole suite,
#   within its run-to-run noise (-O0 was slower: its code runs slowly).
# - XLA's older CPU fusion code generation, not its fusion emitters (the default since 2025): the same
#   optimized program, its fused loops emitted another way. Measured, -n 2 on 2 cores: test_train.py with
#   test_model.py 151 -> 133 s, test_shard.py with test_long_context.py 173 -> 150 s, 13-15% less CPU.
#   What the tests compare is what our code computes, against references or against itself under the same flags;
#   train.py run by a user keeps XLA's defaults.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu locks itself to one process; -n 2 runs two
# PyTorch's OpenMP threads sleep when idle, not spin: two workers and their processes share 2 cores, and a
# spinning thread takes a core from the other worker. Measured, bench/reference.py's test beside
# tests/test_model.py: 109 -> 78 s, 150 -> 109 s of CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# glibc's malloc backs its large blocks with transparent huge pages (glibc 2.35+; ignored elsewhere): XLA's
# and PyTorch's buffers of megabytes, allocated and freed every step, fault in 2 MiB at a time, not 4 KiB.
# Read when a process starts: the pytest workers and every process they start. Measured, -n 2 on 2 cores:
# tests/test_resume.py with tests/test_fp8.py, 13.5 M -> 2.5 M page faults, 187 -> 163 s, 338 -> 292 s of CPU.
# And blocks up to 32 MiB (glibc's most) come from the heap, which keeps what is freed: XLA's step buffers are
# reused, not mapped afresh and zeroed by the kernel each step (a profile put 11% of the suite's CPU in the
# kernel's page clearing). Measured, fresh caches: tests/test_resume.py with tests/test_fp8.py 240 -> 223 s,
# 370 -> 345 s of CPU; tests/test_train.py with tests/test_shard.py 303 -> 286 s, 441 -> 408 s of CPU.
os.environ.setdefault(
    "GLIBC_TUNABLES",
    "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296",
)
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
def uninterrupted(tiny_data, tmp_path_factory):
    """The tiny run of tests/commands.py's FLAGS, uninterrupted, on a local disk, made once per process: what
    the runs killed, stopped or weathered on a disk and in a bucket must equal bit for bit. Read, never written."""
    from commands import run

    run_dir = tmp_path_factory.mktemp("uninterrupted")
    out = run(run_dir, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def gcs_behind_proxy():
    """A Cloud Storage server on 127.0.0.1 for the session, behind a servers.FaultProxy (in fair weather it
    only relays), and the clients pointed at the proxy (servers.gcs_emulator), one per process: every storage
    test of the process talks to the one server, whether it injects faults or not. Returns the proxy."""
    from servers import FaultProxy, gcs_emulator

    with FaultProxy() as proxy, gcs_emulator(proxy):
        yield proxy


@pytest.fixture(scope="session")
def gcs_emulator(gcs_behind_proxy):
    """The session's Cloud Storage server (gcs_behind_proxy). Returns a storage client of it."""
    from google.cloud import storage

    return storage.Client()


@pytest.fixture
def gcs_proxy(gcs_behind_proxy):
    """The FaultProxy in front of the session's Cloud Storage server, in fair weather with an empty log before
    the test and after it (no outage left for the clients a test leaves behind). Its url is the server's."""
    gcs_behind_proxy.clear()
    yield gcs_behind_proxy
    gcs_behind_proxy.clear()


@pytest.fixture(scope="session")
def s3_server():
    """An S3 server on 127.0.0.1 for the session (servers.s3_server), one per process, as gcs_emulator. Returns
    a boto3 client of it."""
    import boto3
    from servers import s3_server

    with s3_server():
        yield boto3.client("s3")


def pytest_collection_finish(session):
    """Python's full garbage collections scan every object a worker holds (the modules of jax, torch,
    transformers and the objects tests leave), 0.2-0.3 s each, one every 4 s or so of tests that trace. Measured,
    five of test_train.py's runs: 2.6 of 47 s. So the objects the imports made are frozen (never scanned again),
    and a full collection comes after 1,000 collections of the middle generation, not 10: every few minutes,
    with 0.3 s of collecting left in those runs (a cycle a test leaves waits longer to be freed). Only in the
    pytest workers: the train.py processes the tests start keep Python's defaults."""
    gc.freeze()
    gc.set_threshold(700, 10, 1000)
