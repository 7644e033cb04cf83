"""bench/compare.py, the logit checker: our model, read from a run directory, against transformers running the
same weights passes; one weight scaled by 1.01 fails; bad flags are refused before any model loads."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_models import make_hf, markov_tokens, train_briefly
from tolerance import loss_terms, sum_tol

import ckpt

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 1000


def compare_cli(*args):
    return subprocess.run(
        [sys.executable, "bench/compare.py", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A briefly trained transformers model (confident, as a trained checkpoint is: a random one's top-1 is a
    coin toss under any rounding) as an HF directory and as step 0 of a run directory, and held-out tokens
    of the chain it learned."""
    root = tmp_path_factory.mktemp("compare")
    hf = train_briefly(make_hf(root / "hf", heads=8, kv_heads=2, vocab=VOCAB, save=False), steps=30)
    hf.save_pretrained(root / "hf")
    ckpt.import_hf(root / "hf", root / "run")
    held_out = root / "held-out.bin"
    markov_tokens(VOCAB, 1024, 8, seed=10_000).astype(np.uint16).tofile(held_out)
    return root, held_out


@pytest.mark.slow
def test_compare_passes_the_same_weights_and_catches_an_altered_one(weights, tmp_path):
    from safetensors.numpy import load_file, save_file

    root, held_out = weights
    shutil.copytree(root / "hf", tmp_path / "altered")
    tensors = load_file(tmp_path / "altered" / "model.safetensors")
    tensors["model.layers.1.post_feedforward_layernorm.weight"] *= 1.01
    save_file(tensors, tmp_path / "altered" / "model.safetensors", metadata={"format": "pt"})
    limits = ["--data", held_out, "--seq_len", "64,512", "--tokens", "2048", "--min_top1", "0.999"]
    limits += ["--max_token_loss_diff", "1e-4", "--max_kl", "1e-8"]
    exact = compare_cli(root / "run", f"transformers:{root / 'hf'}", *limits)
    assert exact.returncode == 0 and "within tolerances" in exact.stdout, exact.stdout + exact.stderr[-2000:]
    rows = [line.split() for line in exact.stdout.splitlines() if line.strip().split()[0] in ("64", "512")]
    assert [(r[0], r[1]) for r in rows] == [("64", "32"), ("512", "4")]  # length, sequences
    cfg = ckpt.load_hf(root / "hf").cfg
    for length, sequences, ours, theirs in ((int(a), int(b), float(c), float(d)) for a, b, c, d, *_ in rows):
        # The two sides' mean losses, each printed to 5 decimals (half a unit off), apart by fp32 rounding
        tol = 1e-5 + sum_tol(loss_terms(cfg, length, sequences * (length - 1)), theirs)
        assert ours == pytest.approx(theirs, abs=tol)
    altered = compare_cli(root / "run", f"transformers:{tmp_path / 'altered'}", *limits)
    assert altered.returncode == 1, altered.stdout + altered.stderr[-2000:]
    assert "FAILED: max KL at 64" in altered.stdout and "FAILED: max KL at 512" in altered.stdout


@pytest.mark.parametrize("flag,value", [("--seq_len", "0"), ("--seq_len", "abc"), ("--chunk", "-1")])
def test_a_bad_number_is_refused_naming_its_flag_before_anything_loads(tmp_path, flag, value):
    out = compare_cli(
        tmp_path / "nowhere", tmp_path / "nor-here", "--data", tmp_path / "none.bin", flag, value
    )
    assert out.returncode == 2 and out.stdout == "", out.stderr[-2000:]
    assert (
        out.stderr.strip().splitlines()[-1].startswith(f"bench/compare.py: error: argument {flag}: '{value}'")
    )
