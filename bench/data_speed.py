"""Data throughput: TokenLoader batches from token files (local, over HTTP, from a GCS emulator), the wait a
prefetched step sees, stage 3's start (cold and cached), batch_hash, the repeat filter, the permutation and the
bytes a host reads of its cache at a start, the tokenizers.

python bench/data_speed.py           # about 4 minutes on 2 CPU cores; writes ~2 GB to a temp folder
python bench/data_speed.py --full    # also builds the real mix's permutation (723,872,768 instances) and its cache
python bench/data_speed.py --small   # every row at a small size, seconds: a check that it runs through
"""

import argparse
import glob
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # tokenize() must not reach for the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/servers.py: the GCS emulator and the HTTP file server the tests use
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import numpy as np
from servers import FileServer, gcs_emulator

import data

SEQ, BATCH = 8192, 64  # the 7B run's sequence, and 64 of its 512 rows: one host's share at 8 hosts
OLMO3_INSTANCES = 512 * 1_413_814  # at least this many instances in OLMo-mix-0625-official
# What each row measures at: tokens per file (6 files), batches read cold, rows hashed, instances permuted,
# plays encoded (None: all 38), copies of them tokenized, prefetched steps and their seconds, stage 3's mix
# (8 files). --small runs the same code on SMALL, which measures nothing.
SIZE = dict(
    file_tokens=25_000_000,
    batches=20,
    hash_rows=(64, 512),
    instances=100_000_000,
    plays=None,
    copies=4,
    steps=10,
    step_s=1.0,  # about the 7B's step on its slice (7.7K tokens/s a GPU, OLMo 3's report)
    stage3_bytes=2**30,
)
SMALL = dict(
    file_tokens=1_000_000,
    batches=2,
    hash_rows=(64,),
    instances=1_000_000,
    plays=2,
    copies=1,
    steps=3,
    step_s=0.1,
    stage3_bytes=2**23,
)
STAGE3_SEQ = 65536  # the long-context stage's rows


def timed(fn, *args, repeat=1):
    """Seconds per call of fn(*args), and its result."""
    t = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)
    return (time.perf_counter() - t) / repeat, out


def loader_speed(folder, rows, size) -> list[str]:
    """Batches/s of global_batch with the files evicted from the page cache (cold), then cached (warm); returns
    the files."""
    rng = np.random.default_rng(0)
    paths = []
    for k in range(6):  # 6 files x 25M uint32 tokens = 600 MB, lengths not multiples of SEQ
        paths.append(os.path.join(folder, f"{k:06d}.npy"))
        rng.integers(0, 100278, size["file_tokens"] + 977 * k, dtype=np.uint32).tofile(paths[-1])
    loader = data.TokenLoader(paths, SEQ, BATCH, seed=0, vocab_size=100278)
    for p in paths:  # evict: the first reads come from the disk
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    n = size["batches"]
    cold, _ = timed(lambda: [loader.global_batch(i) for i in range(n)])  # batches 0..19 from the disk
    for p in paths:  # warm: every file in the page cache
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    warm, _ = timed(lambda: [loader.global_batch(i) for i in range(n, 3 * n)])
    for name, seconds, batches in (("cold", cold, n), ("warm", warm, 2 * n)):
        per_s = batches / seconds
        rows.append(
            (
                f"TokenLoader.global_batch, {BATCH} x {SEQ}, page cache {name}",
                (
                    f"{per_s:.1f} batches/s = {per_s * BATCH * SEQ / 1e6:.1f}M tokens/s "
                    f"({per_s * BATCH * SEQ * 4 / 1e6:.0f} MB/s)"
                ),
            )
        )
    batch = loader.global_batch(0)
    for b in size["hash_rows"]:
        seconds, _ = timed(data.batch_hash, np.tile(batch, (b // BATCH, 1)), repeat=5)
        rows.append((f"batch_hash, {b} x {SEQ}", f"{seconds * 1e3:.1f} ms"))
        # The 32B's instance filter (OLMo-core's, periods 1-13, 32 repeats) on the prefetch thread: it must
        # take less than a step, which for the 7B's or 32B's batch is seconds on any slice.
        seconds, _ = timed(data.repeated, np.tile(batch, (b // BATCH, 1)), 32, repeat=3)
        rows.append((f"repeat filter (data.repeated), {b} x {SEQ}", f"{seconds * 1e3:.0f} ms"))
    return paths


def upload(folder, bucket_name: str) -> str:
    """The files under a local folder copied to a new bucket of the GCS emulator; returns its gs:// URL."""
    from google.cloud import storage

    bucket = storage.Client().create_bucket(bucket_name)
    for name in sorted(os.listdir(folder)):
        bucket.blob(name).upload_from_filename(os.path.join(folder, name))
    return f"gs://{bucket_name}"


def remote_speed(paths, rows, size):
    """The files of loader_speed over HTTP (Python's threaded server) and from the GCS emulator, both on
    127.0.0.1: batches/s read straight, then the wait a step sees with the prefetcher 2 batches ahead and a step
    of step_s, against the local files (page cache warm)."""
    folder, names = os.path.dirname(paths[0]), [os.path.basename(p) for p in paths]
    http = FileServer(folder)
    roots = {"local files": folder, "over HTTP (127.0.0.1)": http.url}
    roots["GCS emulator (127.0.0.1)"] = upload(folder, "bench-tokens")
    n = size["batches"]
    for where, root in roots.items():
        loader = data.TokenLoader([f"{root}/{name}" for name in names], SEQ, BATCH, seed=0, vocab_size=100278)
        if where != "local files":
            seconds, _ = timed(lambda: [loader.global_batch(i) for i in range(n)])
            per_s = n / seconds
            rows.append(
                (
                    f"TokenLoader.global_batch, {BATCH} x {SEQ}, {where}",
                    f"{per_s:.1f} batches/s = {per_s * BATCH * SEQ * 4 / 1e6:.0f} MB/s, {per_s * BATCH:.0f} reads/s",
                )
            )
        waits = prefetched_waits(loader, size["steps"], size["step_s"])
        rows.append(
            (
                f"data_wait_s a step, prefetched 2 ahead, steps of {size['step_s']} s, {where}",
                f"first {waits[0] * 1e3:.0f} ms, then mean {np.mean(waits[1:]) * 1e3:.2f} ms, max {max(waits[1:]) * 1e3:.2f} ms",
            )
        )
    http.shutdown()


def prefetched_waits(loader, steps: int, step_s: float) -> list[float]:
    """What train.py logs as data_wait_s: each step's wait for its batch from data.Prefetcher, a step taking
    step_s (the device's time, here a sleep)."""
    prefetcher = data.Prefetcher(loader.global_batch, 0, steps, lambda batch: batch)
    waits = []
    for _, _, wait in prefetcher:
        waits.append(wait)
        time.sleep(step_s)
    prefetcher.close()
    return waits


def stage3_start(folder, rows, size):
    """Seconds from nothing to stage 3's first batch (PackedLoader: files' sizes, the document index, packing,
    the permutation, batch 0) on a mix of 8 files of stage3_bytes in all, cold (every token scanned, the
    caches written) and again with the caches in its work directory: local, then data and work directory on
    the GCS emulator; and the bytes of the caches (16 an instance, 24 a document), which every host reads
    whole at each start."""
    mix = os.path.join(folder, "stage3")
    os.makedirs(mix)
    rng = np.random.default_rng(0)
    for k in range(8):  # documents of 100 to 100,000 tokens, EOS-terminated
        tokens = rng.integers(2, 100278, size["stage3_bytes"] // 32, dtype=np.uint32)
        ends = np.cumsum(rng.integers(100, 100_000, len(tokens) // 100 + 1))
        tokens[ends[ends <= len(tokens)] - 1] = 100257
        tokens[-1] = 100257
        tokens.tofile(os.path.join(mix, f"{k:03d}.npy"))
    gb = size["stage3_bytes"] / 2**30
    remote = upload(mix, "bench-stage3")
    places = {"local": (mix, os.path.join(folder, "work")), "GCS emulator": (remote, f"{remote}/run/data")}
    for where, (root, work) in places.items():
        for start in ("cold: every token scanned", "cached in its work_dir"):
            files = [f"{root}/{name}" for name in sorted(os.listdir(mix))]
            packing = dict(eos_id=100257, pad_id=100277, group_size=2, file_seed=123, seed=0, work_dir=work)
            seconds, _ = timed(lambda: data.PackedLoader(files, STAGE3_SEQ, 8, **packing).global_batch(0))
            rows.append(
                (f"stage 3 start to batch 0, {gb:.2g} GB in 8 files, {where}, {start}", f"{seconds:.2f} s")
            )
    caches = glob.glob(os.path.join(folder, "work", "dataset-common", "*"))
    of = lambda kind: sum(os.path.getsize(p) for p in caches if os.path.basename(p).startswith(kind))
    instances, documents = of("instance-offsets") // 16, of("documents-by-instance") // 8
    rows.append(
        (
            f"stage 3 start: the packing caches each host reads whole, {gb:.2g} GB in 8 files",
            f"{sum(map(os.path.getsize, caches)):,} bytes ({instances:,} instances x 16 + {documents:,} documents x 24)",
        )
    )


def order_start_reads(folder, n: int) -> tuple[float, int, int, int]:
    """What a host reads of the order's cache at a start: the cache of n instances built and written to a
    local work_dir, then served over HTTP (tests/servers.py's server logs each request's Range), and a host (3
    of 8) of a run of 512 a batch, restarting in the middle, reads the 3 batches the prefetcher reads first.
    Returns the seconds to build and write the cache, the bytes of its checksums and of the blocks read, and
    the requests. (Before, every host read the whole file, 4 bytes an instance.) No time: the test server reads
    a whole file to answer a HEAD, seconds at 2.9 GB, which a real server answers from its metadata."""
    work, batch = os.path.join(folder, f"order-{n}"), 512
    built, _ = timed(lambda: data.GlobalOrder(n, batch, 34521, 1, work, "instances").batch_indices(0))
    [cache] = glob.glob(os.path.join(work, "global_indices_*.npy"))
    http = FileServer(work)
    order = data.GlobalOrder(n, batch, 34521, 1, http.url, "instances", share=(3, 8))
    start = order.num_batches // 2
    for i in range(start, start + 3):
        order.batch_indices(i)
    gets = [re.fullmatch(r"bytes=(\d+)-(\d+)", r).groups() for method, _, r, _ in http.log if method == "GET"]
    http.shutdown()
    checksums = os.path.getsize(data.checksums_path(cache))
    return built, checksums, sum(int(b) + 1 - int(a) for a, b in gets) - checksums, len(http.log)


def order_rows(folder, rows, size, full: bool) -> None:
    """order_start_reads at the bench's size, and for the 7B's mix: measured with --full, else computed (the
    checksums' file as write_checksums writes it, and one block)."""
    for n in [size["instances"]] + [OLMO3_INSTANCES] * full:
        built, checksums, blocks, requests = order_start_reads(folder, n)
        rows.append(
            (f"order cache of {n:,} instances built and written, with its checksums", f"{built:.1f} s")
        )
        rows.append(
            (
                f"bytes a host reads of the order at a start, {n:,} instances: before / after",
                f"{4 * n:,} / {checksums + blocks:,} (checksums {checksums:,}, blocks {blocks:,}; {requests} requests)",
            )
        )
    if not full:
        blocks = -(-4 * OLMO3_INSTANCES // data.CHECKED_BLOCK)
        sidecar = {
            "bytes": 4 * OLMO3_INSTANCES,
            "block_bytes": data.CHECKED_BLOCK,
            "blake2b_64": ["0" * 16] * blocks,
        }
        checksums = len(json.dumps(sidecar))
        rows.append(
            (
                f"bytes a host reads of the order at a start, {OLMO3_INSTANCES:,} instances: before / after, computed",
                f"{4 * OLMO3_INSTANCES:,} / {checksums + data.CHECKED_BLOCK:,} (checksums {checksums:,}, one block)",
            )
        )


def permutation_speed(n):
    """Time and peak memory of global_indices(n) in a fresh process."""
    # VmHWM, the process's peak resident memory (ru_maxrss would carry over this parent's peak across exec).
    code = (
        f"import re, time, data\n"
        f"hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]) * 1024\n"
        f"base = hwm(); t = time.perf_counter(); p = data.global_indices({n}, 0, 1)\n"
        f"print(time.perf_counter() - t, hwm() - base)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    seconds, peak = map(float, out.stdout.split())
    return seconds, peak


def tokenizer_speed(folder, rows, size):
    plays = data.tiny_plays()
    texts = (plays["train"] + plays["val"])[: size["plays"]]
    copies = size["copies"]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    tiny = data.prepare_tiny(os.path.join(folder, "tiny"))
    for name, path in (("dolma2", None), ("tiny", tiny["tokenizer"])):
        tok = data.get_tokenizer(name, path)
        one, ids = timed(lambda encode: [encode(t) for t in texts], tok.encode)
        batch, _ = timed(tok.encode_batch, texts)
        n = sum(map(len, ids))
        rows.append(
            (
                f"{name} encode, one thread, {mb:.1f} MB of Shakespeare",
                f"{mb / one:.1f} MB/s ({n / one / 1e6:.2f}M tokens/s, {n:,} tokens)",
            )
        )
        rows.append((f"{name} encode_batch (the tokenizer's own threads)", f"{mb / batch:.1f} MB/s"))
    srcs = []
    for copy in range(copies):  # 4 copies of all: 152 documents, 21 MB, enough for num_proc to matter
        for k, text in enumerate(texts):
            srcs.append(os.path.join(folder, "txt", f"{copy}-{k:02d}.txt"))
            os.makedirs(os.path.dirname(srcs[-1]), exist_ok=True)
            with open(srcs[-1], "w", encoding="utf-8") as f:
                f.write(text)
    for num_proc in (1, 2):
        seconds, _ = timed(data.tokenize, srcs, os.path.join(folder, f"out{num_proc}"), "dolma2", num_proc)
        rows.append(
            (
                f"tokenize(.txt, dolma2, num_proc={num_proc}), {copies * mb:.0f} MB end to end",
                f"{copies * mb / seconds:.1f} MB/s ({seconds:.1f} s)",
            )
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="build the permutation at the real mix's size")
    parser.add_argument("--small", action="store_true", help="every row at a small size (a check)")
    args = parser.parse_args()
    size = SMALL if args.small else SIZE
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        paths = loader_speed(folder, rows, size)
        with gcs_emulator():
            remote_speed(paths, rows, size)
            stage3_start(folder, rows, size)
        for n in [size["instances"]] + [OLMO3_INSTANCES] * args.full:
            seconds, peak = permutation_speed(n)
            rows.append(
                (
                    f"global_indices({n:,})",
                    f"{seconds:.1f} s, peak +{peak / 1e9:.2f} GB ({peak / n:.1f} bytes/instance)",
                )
            )
        if not args.full:
            scale = OLMO3_INSTANCES / size["instances"]
            rows.append(
                (
                    f"global_indices({OLMO3_INSTANCES:,}), extrapolated",
                    f"~{seconds * scale:.0f} s, ~{peak * scale / 1e9:.1f} GB",
                )
            )
        order_rows(folder, rows, size, args.full)
        n = size["instances"]
        data.global_indices(n, 1, 1).tofile(os.path.join(folder, "perm.npy"))
        seconds, _ = timed(
            lambda: int(np.memmap(os.path.join(folder, "perm.npy"), np.uint32, "r").sum(dtype=np.uint64))
        )
        rows.append((f"permutation cache check (sum of {n:,} uint32, page cache warm)", f"{seconds:.2f} s"))
        tokenizer_speed(folder, rows, size)
    width = max(len(name) for name, _ in rows)
    print(f"{'what':<{width}} | result\n{'-' * width}-|-------")
    for name, result in rows:
        print(f"{name:<{width}} | {result}")
    print(f"peak memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
