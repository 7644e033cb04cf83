"""The LM evaluation against OLMo-core's own: its NumpyPaddedFSLDataset's instances, and its LMEvaluator's CE
loss and PPL over transformers' Olmo3 logits, for labelled held-out sets."""

import dataclasses
import json

import equinox as eqx
import jax
import numpy as np
import pytest
import torch
from hf_models import hf_logits, make_hf
from olmo_core.data import NumpyPaddedFSLDataset
from olmo_core.data.utils import get_labels
from olmo_core.eval.lm_evaluator import LMEvaluator
from olmo_core.nn.functional import cross_entropy_loss
from tolerance import sum_tol, token_terms

import ckpt
import data
import olmo3
import shard
import train

VOCAB, PAD, EOS, SEQ = 384, 0, 1, 16  # make_hf's special ids; a vocabulary our model need not pad


def write_docs(path, lengths, seed, tail=0):
    """Documents of these lengths (EOS last, no other EOS or pad inside), then `tail` tokens with no EOS."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(2, VOCAB, n - 1), EOS) for n in lengths] + [rng.integers(2, VOCAB, tail)]
    np.concatenate(docs).astype(np.uint16).tofile(path)
    return str(path)


@pytest.fixture
def held_out(tmp_path):
    """Labelled sets of documents shorter than, as long as and longer than SEQ, one file ending in stray
    tokens; wiki's 11 documents fill more than one batch of 8."""
    return {
        "c4": [
            write_docs(tmp_path / "c4-0.npy", [5, 40, 16, 1], 0, tail=7),
            write_docs(tmp_path / "c4-1.npy", [9], 1),
        ],
        "books": [write_docs(tmp_path / "books.npy", [17, 3, 30, 12, 2], 2)],
        "wiki": [write_docs(tmp_path / "wiki.npy", [4, 20, 7, 16, 2, 33, 9, 11, 15, 3, 18], 3)],
    }


def olmo_core_set(paths, label, work_dir):
    dataset = NumpyPaddedFSLDataset(
        *paths,
        sequence_length=SEQ,
        pad_token_id=PAD,
        eos_token_id=EOS,
        vocab_size=VOCAB,
        dtype=np.uint16,
        metadata=[{"label": label}] * len(paths),
    )
    dataset.work_dir = work_dir
    dataset.prepare()
    return dataset


def test_instances_are_olmo_cores_padded_instances(held_out, tmp_path):
    for label, paths in held_out.items():
        ref = olmo_core_set(paths, label, tmp_path / "work")
        ours = data.PaddedEvalSet(label, paths, SEQ, EOS, PAD, np.uint16)
        tokens, mask = ours.rows(np.arange(len(ours) + 2), stop=len(ours))  # and two empty rows
        assert len(ours) == len(ref)
        np.testing.assert_array_equal(
            tokens[: len(ref)], np.stack([ref[i]["input_ids"] for i in range(len(ref))])
        )
        np.testing.assert_array_equal(
            mask[: len(ref)], np.stack([ref[i]["label_mask"] for i in range(len(ref))])
        )
        assert (tokens[len(ref) :] == PAD).all() and not mask[len(ref) :].any()


def olmo_core_metrics(hf, held_out, work_dir, limit=None):
    """LMEvaluator's metrics: OLMo-core's eval loop (get_labels, per-token CE with reduction "none",
    update_metrics, compute_metrics) over transformers' logits, in batches of 3 instances; with `limit`, over
    each set's first `limit` instances only."""
    labels = list(held_out)
    evaluator = LMEvaluator(name="lm", batches=[], labels=labels, device=torch.device("cpu"))
    for label, paths in held_out.items():
        dataset = olmo_core_set(paths, label, work_dir)
        n = min(len(dataset), limit or len(dataset))
        for first in range(0, n, 3):
            items = [dataset[i] for i in range(first, min(first + 3, n))]
            batch = {k: torch.stack([item[k] for item in items]) for k in ("input_ids", "label_mask")}
            batch["metadata"] = [item["metadata"] for item in items]
            logits = torch.as_tensor(hf_logits(hf, batch["input_ids"]))
            targets = get_labels(batch)
            ce, _ = cross_entropy_loss(logits.view(-1, VOCAB), targets.view(-1), reduction="none")
            evaluator.update_metrics(batch, ce.view(targets.shape), logits)
    return {f"eval/lm/{name}": float(value) for name, value in evaluator.compute_metrics().items()}


def test_evaluate_matches_olmo_cores_lm_evaluator(held_out, tmp_path, monkeypatch):
    hf = make_hf(tmp_path / "hf", vocab=VOCAB)
    spec = ",".join(f"{label}={','.join(paths)}" for label, paths in held_out.items())  # c4=a,b,books=c,...
    cfg = dataclasses.replace(
        train.PRESETS["tiny"],
        data=write_docs(tmp_path / "train.npy", [8 * SEQ], 3),  # one batch to train on: not read here
        eval_data=spec,
        seq_len=SEQ,
        global_batch=8,
        mesh="data=2,fsdp=4",
        run_dir=str(tmp_path / "run"),
        eval_batches=0,
        steps=1,
    )
    mesh = shard.make_mesh(cfg.mesh)
    compute = olmo3.Compute(dtype="float32", attention="reference")
    model = ckpt.load_hf(tmp_path / "hf", compute=compute)
    model = eqx.filter_shard(model, shard.shardings(model, mesh))
    run = train.open_run(train.plan_run(cfg, mesh, model.cfg, compute))
    with jax.set_mesh(mesh):
        train.evaluate(run, 7, model)  # the whole sets
        train.evaluate(dataclasses.replace(run, cfg=dataclasses.replace(cfg, eval_batches=1)), 8, model)
        # Two microbatches of 8 rows a step: the sets go through 8 rows at a time, the same numbers.
        halves = dataclasses.replace(run, cfg=dataclasses.replace(cfg, global_batch=16), n_micro=2)
        shapes, step = [], train.eval_step
        monkeypatch.setattr(train, "eval_step", lambda m, b, *a: shapes.append(b.shape) or step(m, b, *a))
        train.evaluate(halves, 9, model)
        assert set(shapes) == {(8, SEQ)}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row, limit in zip(rows, (None, 8, None), strict=True):  # --eval_batches 1: each set's first 8
        expected = olmo_core_metrics(hf, held_out, tmp_path / "work", limit)
        assert row.keys() == {"step", "eval_loss", "eval_ppl", *expected}
        for name, value in expected.items():
            # fp32 rounding of a token's loss through the model's sums (a set's mean CE is off by no more);
            # PPL = exp(CE) by the CE's error times the CE
            rel = sum_tol(token_terms(model.cfg, SEQ)) * (max(1.0, np.log(value)) if "PPL" in name else 1)
            assert row[name] == pytest.approx(value, rel=rel), name
        assert row["eval_loss"] == row["eval/lm/c4/CE loss"]
    assert [row["step"] for row in rows] == [7, 8, 9] and rows[0]["eval/lm/wiki/CE loss"] != rows[1][
        "eval/lm/wiki/CE loss"
    ]


@pytest.mark.parametrize(
    "spec, says",
    [
        (
            "val={d}/nothing.npy",
            "--eval_data 'val={d}/nothing.npy' (set val): token file {d}/nothing.npy does not exist",
        ),
        (
            "{d}/c4-0.npy,val={d}/books.npy",
            "--eval_data '{d}/c4-0.npy,val={d}/books.npy': '{d}/c4-0.npy' has no label",
        ),
        (
            "a={d}/c4-0.npy,a={d}/books.npy",
            "--eval_data 'a={d}/c4-0.npy,a={d}/books.npy': set 'a' is given twice",
        ),
        (
            "a=,b={d}/books.npy",
            "--eval_data 'a=,b={d}/books.npy': set a names no token file; expected a=FILES",
        ),
        ("val={d}", "--eval_data 'val={d}' (set val): {d} is a directory"),
        ("{d}/mix.txt", "--eval_data {d}/mix.txt line 2: label ''; expected 'label,path'"),
        ("{d}/gone.txt", "--eval_data {d}/gone.txt line 1 (c4): token file {d}/c4-9.npy does not exist"),
    ],
)
def test_held_out_sets_given_are_scored_or_refused(held_out, tmp_path, spec, says):
    d = str(tmp_path)
    (tmp_path / "mix.txt").write_text("c4,c4-0.npy\n,books.npy\n")
    (tmp_path / "gone.txt").write_text("c4,c4-9.npy\n")
    with pytest.raises(data.DataError) as refused:
        data.resolve(held_out["books"][0], d, spec.format(d=d))
    assert str(refused.value).startswith(says.format(d=d)) and "\n" not in str(refused.value)


def test_a_file_with_no_document_is_refused(tmp_path):
    path = write_docs(tmp_path / "x.npy", [], 0, tail=9)
    with pytest.raises(data.DataError, match=f"^{path}: no EOS \\(id 1\\) in its 9 tokens"):
        data.PaddedEvalSet("x", [path], SEQ, EOS, PAD, np.uint16)


def test_mix_file_sets_and_the_tiny_default(held_out, tmp_path, tiny_data):
    (tmp_path / "v3-small-ppl-validation.txt").write_text(
        "# a comment\nc4,c4-0.npy\nc4,c4-1.npy\nbooks,{TOKENIZER}/books.npy\n"
    )
    (tmp_path / "dolma2-tokenizer").mkdir()
    (tmp_path / "books.npy").rename(tmp_path / "dolma2-tokenizer" / "books.npy")  # OLMo-core's name for it
    _, sets, _ = data.resolve(held_out["c4"][0], str(tmp_path), str(tmp_path / "v3-small-ppl-validation.txt"))
    assert sets == {"c4": held_out["c4"], "books": [str(tmp_path / "dolma2-tokenizer" / "books.npy")]}
    _, sets, _ = data.resolve("tiny", str(tiny_data))
    assert list(sets) == ["tiny-val"]
    _, sets, _ = data.resolve("tiny", str(tiny_data), f"c4={held_out['c4'][1]}")  # given: scored, not ignored
    assert sets == {"c4": [held_out["c4"][1]]}
    _, sets, _ = data.resolve(held_out["c4"][0], "", held_out["c4"][1])  # unlabelled files: one set
    assert sets == {"held-out": [held_out["c4"][1]]}


def test_a_missing_held_out_set_stops_a_tiny_run_in_one_line(tiny_data, tmp_path, capsys):
    """--data tiny once scored its own held-out plays and ignored --eval_data: now the set given is read."""
    argv = ["--preset", "tiny", "--data_root", str(tiny_data), "--eval_data", "val=nothing.npy"]
    assert train.cli([*argv, "--run_dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --eval_data 'val=nothing.npy' (set val): token file nothing.npy does not exist"
