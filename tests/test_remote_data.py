"""Token data by URL: the loaders read gs://, s3:// and http(s):// files by byte range from real servers started
here on 127.0.0.1 (a Cloud Storage emulator and moto's S3 server, from PyPI; Python's HTTP server, taught Range
requests, 503s and 403s), and their batches are the ones numpy and OLMo-core read from the local copies of the
same files."""

import os
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest
from servers import FileServer

import data

ROOT = os.path.dirname(os.path.abspath(data.__file__))
SEQ, SEED, VOCAB, EOS, PAD = 64, 34521, 1000, 1, 0
DTYPE = np.uint16


@pytest.fixture
def http_server():
    """Start FileServers (stopped after the test): http_server(root, fail=..., refuse=...)."""
    servers = []

    def start(root, **kw) -> FileServer:
        servers.append(FileServer(root, **kw))
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def at_url(request, http_server):
    """at_url(scheme, folder): the URL the files under a local folder are served at, over HTTP or uploaded to a
    fresh bucket of the GCS emulator or the S3 server."""

    def serve(scheme: str, folder) -> str:
        if scheme == "http":
            return http_server(folder).url
        name = f"data-{uuid.uuid4().hex[:12]}"
        if scheme == "gs":
            bucket = request.getfixturevalue("gcs_emulator").create_bucket(name)
            upload = lambda path, key: bucket.blob(key).upload_from_filename(path)
        else:
            s3 = request.getfixturevalue("s3_server")
            s3.create_bucket(Bucket=name)
            upload = lambda path, key: s3.upload_file(path, name, key)
        for parent, _, names in os.walk(folder):
            for file in names:
                upload(os.path.join(parent, file), os.path.relpath(os.path.join(parent, file), folder))
        return f"{scheme}://{name}"

    return serve


def write_documents(folder, tokens=(1000, 37, 513, 2048, 300, 640), seed=0) -> list[str]:
    """Token files of EOS-terminated documents of 1 to 200 tokens, each file about `tokens` long."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for k, n in enumerate(tokens):
        lengths = rng.choice([1, 5, 16, 31, 63, 64, 65, 128, 200], n // 40 + 1)
        documents = [np.append(rng.integers(2, VOCAB, length - 1), EOS) for length in lengths]
        paths.append(os.path.join(folder, f"{k:03d}.npy"))
        np.concatenate(documents).astype(DTYPE).tofile(paths[-1])
    return paths


def numpy_instances(paths) -> np.ndarray:
    """Instances cut with plain numpy: each file on its own, SEQ tokens each, remainders dropped."""
    tokens = [np.fromfile(p, DTYPE) for p in paths]
    return np.array([t[k * SEQ : (k + 1) * SEQ] for t in tokens for k in range(len(t) // SEQ)], np.uint32)


def numpy_documents(paths) -> list[np.ndarray]:
    """Every document of the files in order (to each EOS, kept), its first SEQ tokens, with plain numpy."""
    tokens = [np.fromfile(p, DTYPE) for p in paths]
    return [d[:SEQ] for t in tokens for d in np.split(t, np.flatnonzero(t == EOS) + 1) if len(d)]


@pytest.mark.parametrize("scheme", ["http", "gs", "s3"])
def test_token_loader_at_a_url_gives_numpy_s_batches_of_the_local_files(tmp_path, scheme, at_url):
    """Stage 1's loader over HTTP (files named under --data_root) and a bucket (a glob, listed): every batch is
    numpy's, bit for bit, and so is its batch_hash; its fingerprint is the local files', so a run resumes
    across the two copies."""
    paths = write_documents(tmp_path / "mix")
    root = at_url(scheme, tmp_path / "mix")
    names = [os.path.basename(p) for p in paths]
    spec, data_root = (",".join(names), root) if scheme == "http" else (f"{root}/*.npy", "")
    files = data.resolve(spec, data_root)[0]
    assert files == [f"{root}/{name}" for name in names]
    loader = data.TokenLoader(files, SEQ, 8, seed=SEED, dtype=DTYPE, vocab_size=VOCAB)
    assert loader.fingerprint == data.TokenLoader(paths, SEQ, 8, seed=SEED, dtype=DTYPE).fingerprint
    truth = numpy_instances(paths)
    for i in range(loader.num_batches):
        rows = truth[loader.batch_indices(i)]
        np.testing.assert_array_equal(loader.global_batch(i), rows)
        mine = loader.row_ids(1, 2)
        assert data.batch_hash(loader.local_batch(i, 1, 2), mine) == data.batch_hash(rows[mine], mine)


def test_over_http_sizes_are_heads_and_reads_are_ranges_never_whole_files(tmp_path, http_server):
    paths = write_documents(tmp_path / "mix")
    server = http_server(tmp_path / "mix")
    loader = data.TokenLoader(
        [f"{server.url}/{os.path.basename(p)}" for p in paths], SEQ, 8, seed=SEED, dtype=DTYPE
    )
    for i in range(loader.num_batches):
        loader.global_batch(i)
    heads = [entry for entry in server.log if entry[0] == "HEAD"]
    gets = [entry for entry in server.log if entry[0] == "GET"]
    assert len(heads) == len(paths) and len(gets) == len(paths) + loader.num_batches * 8
    lengths = [
        int(b) - int(a) + 1 for a, b in (re.fullmatch(r"bytes=(\d+)-(\d+)", g[2]).groups() for g in gets)
    ]
    heads = [min(os.path.getsize(p), data.HEAD_BYTES) for p in paths]  # each file's head, checked first
    assert sorted(lengths) == sorted(
        heads + [SEQ * 2] * (loader.num_batches * 8)
    )  # then one read an instance


def test_a_host_reads_of_the_order_only_the_blocks_of_its_steps_from_its_start_on(
    tmp_path, http_server, monkeypatch
):
    """The order's cache in a work directory served over HTTP, read by fresh loaders as hosts (rank of world)
    starting at step 0 or in the middle: each batch is numpy's rows of the brute-force permutation, and the
    host's requests for the cache are its checksums and the blocks its batches lie in, never the whole file."""
    monkeypatch.setattr(data, "CHECKED_BLOCK", 64)  # 16 indices, 2 batches of 8 a block
    paths = write_documents(tmp_path / "mix", tokens=(5000,) * 6)
    truth, work = numpy_instances(paths), tmp_path / "work"
    n, batch, steps = len(truth), 8, 4
    order = data.global_indices(n, SEED, 1)  # checked against OLMo-core's in tests/test_data.py
    data.TokenLoader(paths, SEQ, batch, seed=SEED, dtype=DTYPE, work_dir=str(work)).batch_indices(0)  # built
    [cache] = ["/" + name for name in os.listdir(work) if name.endswith(".npy")]
    server = http_server(work)
    for start in (0, 29):
        for rank, world in ((0, 1), (1, 2), (3, 4)):
            server.log.clear()
            loader = data.TokenLoader(
                paths, SEQ, batch, seed=SEED, dtype=DTYPE, work_dir=server.url, share=(rank, world)
            )
            for i in range(start, start + steps):
                rows = order[i * batch : (i + 1) * batch][rank::world]
                np.testing.assert_array_equal(loader.local_batch(i, rank, world), truth[rows])
            gets = [r for method, p, r, _ in server.log if (method, p) == ("GET", cache)]
            asked = sorted(tuple(map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r).groups())) for r in gets)
            # The blocks the steps' batches lie in, each once, and nothing else of the cache.
            blocks = range(4 * start * batch // 64, -(-4 * (start + steps) * batch // 64))
            assert asked == [(64 * k, 64 * k + 63) for k in blocks]
            # Besides: the cache's size (a HEAD), its checksums' size and the checksums, whole.
            assert [m for m, p, *_ in server.log if (m, p) != ("GET", cache)] == ["HEAD", "HEAD", "GET"]


@pytest.mark.parametrize("scheme", ["http", "gs", "s3"])
def test_held_out_sets_from_a_mix_file_at_a_url_are_numpy_s_documents(tmp_path, scheme, at_url):
    """--eval_data as a mix file at a URL, its lines under --data_root at a URL (as OLMo-core resolves
    `{TOKENIZER}`): each set's padded rows and label masks are the documents numpy finds in the local files."""
    folder, sets = tmp_path / "root", {"c4": [0, 1], "books": [2]}
    tree = "eval/allenai/dolma3-tokenizer"  # {TOKENIZER} of a mix other than OLMo-core's ppl ones
    paths = {
        label: write_documents(folder / tree / label, seed=len(label))[: len(ks)]
        for label, ks in sets.items()
    }
    lines = [
        f"{label},eval/{{TOKENIZER}}/{label}/{os.path.basename(p)}" for label in sets for p in paths[label]
    ]
    (folder / "ppl.txt").write_text("# held-out sets\n" + "\n".join(lines) + "\n")
    root = at_url(scheme, folder)
    held_out = data.eval_sets(f"{root}/ppl.txt", root)
    assert held_out == {
        label: [f"{root}/{tree}/{label}/{os.path.basename(p)}" for p in paths[label]] for label in sets
    }
    for label, files in held_out.items():
        data.check_tokens(files, VOCAB, DTYPE)
        held = data.PaddedEvalSet(label, files, SEQ, EOS, PAD, DTYPE)
        documents = numpy_documents(paths[label])
        tokens, mask = held.rows(np.arange(len(held) + 2), stop=len(held))  # two empty rows past the end
        assert len(held) == len(documents)
        for row, document in enumerate(documents):
            np.testing.assert_array_equal(tokens[row], np.pad(document, (0, SEQ - len(document))))
            np.testing.assert_array_equal(mask[row], np.arange(SEQ) < len(document))
        assert not mask[-2:].any()


def olmo_core_packed_batches(paths, work_dir, batch: int, rank: int, world: int):
    """Stage 3's batches as OLMo-core's own loader reads the local files (its script's settings)."""
    from olmo_core.data import DataCollator, NumpyFSLDataLoader, NumpyPackedFSLDatasetConfig, TokenizerConfig

    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD)
    config = NumpyPackedFSLDatasetConfig(
        paths=paths,
        tokenizer=tokenizer,
        sequence_length=SEQ,
        generate_doc_lengths=True,
        source_group_size=2,
        source_permutation_seed=123,
        work_dir=str(work_dir),
    )
    dataset = config.build()
    dataset.prepare()
    loader = NumpyFSLDataLoader(
        dataset,
        collator=DataCollator(pad_token_id=PAD),
        work_dir=str(work_dir),
        global_batch_size=batch * SEQ,
        seed=SEED,
        dp_world_size=world,
        dp_rank=rank,
    )
    loader.reshuffle(epoch=1)
    return list(loader)


@pytest.mark.parametrize("scheme", ["http", "gs", "s3"])
def test_packed_loader_at_a_url_is_olmo_core_s_on_the_local_files_and_scans_once(
    tmp_path, scheme, at_url, monkeypatch
):
    """Stage 3's packed loader over a URL, its work directory in the bucket (local beside HTTP data): each rank's
    batches, label masks and documents are OLMo-core's from the local files; a second start reads the
    document index from the cache and scans no token."""
    paths = write_documents(tmp_path / "mix", tokens=(1000, 37, 513, 2048, 300, 640, 700, 90))
    root = at_url(scheme, tmp_path / "mix")
    work = str(tmp_path / "run" / "data") if scheme == "http" else f"{root}/run/data"
    urls = [f"{root}/{os.path.basename(p)}" for p in paths]
    packing = dict(eos_id=EOS, pad_id=PAD, group_size=2, file_seed=123, seed=SEED, dtype=DTYPE, work_dir=work)
    ours = data.PackedLoader(urls, SEQ, 4, **packing)
    reference = olmo_core_packed_batches(paths, tmp_path / "olmo-core", 4, rank=1, world=2)
    assert ours.num_batches == len(reference) > 10

    def compare(loader):
        for i, want in enumerate(reference):
            tokens, mask, documents = loader.local_batch(i, 1, 2)
            np.testing.assert_array_equal(tokens, want["input_ids"].numpy())
            np.testing.assert_array_equal(mask, want["label_mask"].numpy())
            lengths = [n[n > 0] for n in want["doc_lens"].numpy()]
            np.testing.assert_array_equal(documents, [np.repeat(np.arange(len(n)), n) for n in lengths])

    compare(ours)

    def no_scan(*args):
        raise AssertionError("a token file was scanned again")

    monkeypatch.setattr(data, "document_spans", no_scan)
    compare(data.PackedLoader(urls, SEQ, 4, **packing))


def test_the_packing_cache_is_olmo_core_s_file_for_file_and_either_reads_the_other_s(tmp_path, monkeypatch):
    """Our document index cache has OLMo-core's names and bytes (NumpyPackedFSLDataset's work_dir), so a work
    directory OLMo-core filled is read without a scan."""
    from olmo_core.data import NumpyPackedFSLDataset

    paths = write_documents(tmp_path / "mix")
    ref = NumpyPackedFSLDataset(
        *paths,
        sequence_length=SEQ,
        pad_token_id=PAD,
        eos_token_id=EOS,
        vocab_size=VOCAB,
        dtype=DTYPE,
        generate_doc_lengths=True,
        source_group_size=2,
    )
    ref.work_dir = tmp_path / "olmo-core"
    ref.prepare()
    data.PackedInstances(paths, SEQ, EOS, PAD, DTYPE, 2, work_dir=str(tmp_path / "ours"))
    theirs, ours = (sorted(os.listdir(tmp_path / w / "dataset-common")) for w in ("olmo-core", "ours"))
    assert ours == theirs and len(ours) == 3 * 3
    for name in ours:
        assert (tmp_path / "ours" / "dataset-common" / name).read_bytes() == (
            tmp_path / "olmo-core" / "dataset-common" / name
        ).read_bytes()
    monkeypatch.setattr(data, "document_spans", lambda *args: pytest.fail("a token file was scanned"))
    packed = data.PackedInstances(paths, SEQ, EOS, PAD, DTYPE, 2, work_dir=str(tmp_path / "olmo-core"))
    assert len(packed) == len(ref)


def test_each_host_scans_its_share_of_the_groups_first_and_reads_the_rest(tmp_path, monkeypatch):
    """Of a pod's first start, host 1 of 2 scans groups 1 and 3 first, then the others it finds no cache of;
    host 0, later, finds every group cached and scans nothing."""
    paths = write_documents(tmp_path / "mix", tokens=(300, 400, 500, 600, 700, 800, 900, 1000))
    scanned, document_spans = [], data.document_spans

    def counted(tokens, path, *args):
        scanned.append(path)
        return document_spans(tokens, path, *args)

    monkeypatch.setattr(data, "document_spans", counted)
    work = str(tmp_path / "run" / "data")
    one = data.PackedInstances(paths, SEQ, EOS, PAD, DTYPE, 2, work_dir=work, share=(1, 2))
    assert scanned == [paths[k] for k in (2, 3, 6, 7, 0, 1, 4, 5)]
    scanned.clear()
    zero = data.PackedInstances(paths, SEQ, EOS, PAD, DTYPE, 2, work_dir=work, share=(0, 2))
    assert scanned == [] and [s.tolist() for s in zero.spans] == [s.tolist() for s in one.spans]


def test_a_server_failing_a_quarter_of_requests_with_503_gives_the_same_batches(tmp_path, http_server):
    """Timeouts and 5xx are retried with backoff (HEADs by us, reads by TensorStore): the batches and held-out
    rows are numpy's though a quarter of all requests fail."""
    paths = write_documents(tmp_path / "mix")
    server = http_server(tmp_path / "mix", fail_every=4)
    urls = [f"{server.url}/{os.path.basename(p)}" for p in paths]
    loader = data.TokenLoader(urls, SEQ, 8, seed=SEED, dtype=DTYPE, vocab_size=VOCAB)
    truth = numpy_instances(paths)
    for i in range(loader.num_batches):
        np.testing.assert_array_equal(loader.global_batch(i), truth[loader.batch_indices(i)])
    held = data.PaddedEvalSet("held-out", urls[:2], SEQ, EOS, PAD, DTYPE)
    tokens, _ = held.rows(np.arange(len(held)), stop=len(held))
    for row, document in enumerate(numpy_documents(paths[:2])):
        np.testing.assert_array_equal(tokens[row, : len(document)], document)
    failed = {method for method, *_ in server.answered(503)}
    assert failed == {"HEAD", "GET"}, server.log


def test_a_stalled_read_is_cut_and_read_again(tmp_path, http_server):
    """A transfer that stalls is cut by TensorStore's low-speed limit (60 s; 1 s here, through its environment
    variable, in a fresh process) and retried: the batch is numpy's."""
    paths = write_documents(tmp_path / "mix")
    server = http_server(tmp_path / "mix", stall=4.0)
    urls, out = [f"{server.url}/{os.path.basename(p)}" for p in paths], str(tmp_path / "batch.npz")
    code = (
        f"import numpy as np, data; l = data.TokenLoader({urls!r}, {SEQ}, 8, seed={SEED}, dtype=np.{DTYPE.__name__}); "
        f"np.savez({out!r}, batch=l.global_batch(0), order=l.batch_indices(0))"
    )
    env = {**os.environ, "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "1"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
    saved = np.load(out)
    np.testing.assert_array_equal(saved["batch"], numpy_instances(paths)[saved["order"]])
    # Each file's HEAD and head, the batch's 8 instances, and the stalled read once more.
    assert server.stall == 0.0 and len(server.log) == 2 * len(paths) + 8 + 1


def test_a_missing_or_refused_url_is_one_line_naming_it(tmp_path, http_server, gcs_emulator, s3_server):
    """A 404 (HTTP, gs:// or s3://) and a 403 stop at the start, in one line naming the URL: the loaders, a mix
    file, --data_root's held-out sets, a bucket that cannot be listed."""
    write_documents(tmp_path / "mix")
    server = http_server(tmp_path / "mix", refuse={"/001.npy"})
    bucket = gcs_emulator.create_bucket(f"data-{uuid.uuid4().hex[:12]}").name
    s3_server.create_bucket(Bucket=bucket)
    cases = [
        (
            lambda: data.TokenLoader(
                [f"{server.url}/000.npy", f"{server.url}/nope.npy"], SEQ, 1, dtype=DTYPE
            ),
            f"token file {server.url}/nope.npy does not exist",
        ),
        (
            lambda: data.TokenLoader([f"{server.url}/001.npy"], SEQ, 1, dtype=DTYPE),
            f"{server.url}/001.npy: size refused (403",
        ),
        (
            lambda: data.TokenLoader([f"gs://{bucket}/nope.npy"], SEQ, 1, dtype=DTYPE),
            f"token file gs://{bucket}/nope.npy does not exist",
        ),
        (lambda: data.resolve(f"{server.url}/mix.txt"), f"mix file {server.url}/mix.txt does not exist"),
        (
            lambda: data.eval_sets("c4=nope.npy", server.url),
            f"--eval_data 'c4=nope.npy' (set c4): token file {server.url}/nope.npy does not exist",
        ),
        (
            lambda: data.TokenLoader([f"s3://{bucket}/nope.npy"], SEQ, 1, dtype=DTYPE),
            f"token file s3://{bucket}/nope.npy does not exist",
        ),
        (lambda: data.resolve(f"s3://{bucket}-gone/*.npy"), f"s3://{bucket}-gone: no such bucket"),
        (lambda: data.resolve(f"gs://{bucket}-gone/*.npy"), f"gs://{bucket}-gone: no such bucket"),
        (
            lambda: data.TokenLoader(["ftp://host/x.npy"], SEQ, 1),
            "ftp://host/x.npy: expected a local path or gs://",
        ),
    ]
    for make, message in cases:
        with pytest.raises((data.DataError, data.StorageError)) as e:
            make()
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_train_py_stops_before_step_1_on_a_missing_url(tmp_path, http_server, tiny_data):
    server = http_server(tmp_path)
    run = tmp_path / "run"
    args = ["--preset", "tiny", "--tokenizer", "tiny", "--data_root", str(tiny_data)]
    out = subprocess.run(
        [sys.executable, "train.py", *args, "--data", f"{server.url}/nope.npy", "--run_dir", str(run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        out.returncode == 1 and out.stderr == f"error: token file {server.url}/nope.npy does not exist\n"
    ), out.stderr[-3000:]
    assert not run.exists()


def test_damaged_caches_on_gs_are_rebuilt_never_trusted(tmp_path, at_url, gcs_emulator, capsys):
    """The permutation and the document index in a gs:// work directory: built once, then a damaged copy (the
    wrong bytes, or cut short) is found and rebuilt, and the batches stay numpy's and OLMo-core's."""
    paths = write_documents(tmp_path / "mix")
    root = at_url("gs", tmp_path / "mix")
    urls, work = [f"{root}/{os.path.basename(p)}" for p in paths], f"{root}/run/data"
    bucket = gcs_emulator.bucket(root[5:])
    permutation = data.global_indices(len(numpy_instances(paths)), SEED, 1)  # checked against OLMo-core's
    np.testing.assert_array_equal(
        data.TokenLoader(urls, SEQ, 8, seed=SEED, dtype=DTYPE, work_dir=work).indices, permutation
    )
    [name] = [b.name for b in bucket.list_blobs(prefix="run/data/global_indices") if b.name.endswith(".npy")]
    for damaged in (
        permutation.tobytes()[:8] + b"\xff" * 4 + permutation.tobytes()[12:],
        permutation.tobytes()[:-4],
    ):
        bucket.blob(name).upload_from_string(damaged)
        loader = data.TokenLoader(urls, SEQ, 8, seed=SEED, dtype=DTYPE, work_dir=work)
        np.testing.assert_array_equal(loader.indices, permutation)
        assert "rebuilding the damaged permutation cache" in capsys.readouterr().out
        assert bucket.blob(name).download_as_bytes() == permutation.tobytes()
    packed = data.PackedInstances(urls, SEQ, EOS, PAD, DTYPE, 3, work_dir=work)
    want = [packed.instance(i) for i in range(len(packed))]
    caches = sorted(b.name for b in bucket.list_blobs(prefix="run/data/dataset-common/"))
    assert len(caches) == 2 * 3
    for damage in (lambda b: b[:-8], lambda b: b[8:] + b[:8], lambda b: np.zeros(len(b), np.uint8).tobytes()):
        for cache in [c for c in caches if c.endswith(caches[0][-68:])]:  # one group's three files (its hash)
            blob = bucket.blob(cache)
            blob.upload_from_string(damage(blob.download_as_bytes()))
        packed = data.PackedInstances(urls, SEQ, EOS, PAD, DTYPE, 3, work_dir=work)
        assert capsys.readouterr().out.count("rebuilding the damaged packing cache") == 1
        for i, (tokens, _, lengths) in enumerate(want):
            got = packed.instance(i)
            np.testing.assert_array_equal(got[0], tokens), np.testing.assert_array_equal(got[2], lengths)


def test_ai2_s_mixes_under_olmo_data_org_resolve_as_olmo_core_resolves_them():
    """--data_root https://olmo-data.org: a mix file's lines are OLMo-core's DataMix.build URLs (no request
    is made here: a mix is read, not its files)."""
    import olmo_core
    from olmo_core.data import DataMix, TokenizerConfig

    mixes = os.path.join(os.path.dirname(olmo_core.__file__), "data", "mixes")
    tokenizer = TokenizerConfig.dolma2().identifier
    for mix in (DataMix.OLMo_mix_0625_official, DataMix.OLMo_longmino_mix_0625):
        want, _ = mix.build("https://olmo-data.org", tokenizer)
        assert data.read_mix(os.path.join(mixes, f"{mix.value}.txt"), "https://olmo-data.org") == want
    want, labels = DataMix.v3_small_ppl_validation.build("https://olmo-data.org/", tokenizer)
    ppl = os.path.join(mixes, "v3-small-ppl-validation.txt")
    lines = data.mix_lines(
        ppl, "https://olmo-data.org/", data.PPL_MIX_TOKENIZER_ID
    )  # as eval_mix_sets reads it
    assert [(label, url) for _, label, url in lines] == list(zip(labels, want))
