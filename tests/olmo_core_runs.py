"""OLMo-core's side of tests/test_olmo_core_ckpt.py: a small OLMo 3 trained by OLMo-core's SkipStepAdamW and saved
by OLMo-core's checkpointer, in one process or as one rank of an FSDP run (torch.multiprocessing starts the
ranks, which import this module alone: torch and OLMo-core, not JAX)."""

import dataclasses
import json
from pathlib import Path

VOCAB, LAYERS, STEPS, SPIKE = 256, 2, 5, 5  # OLMo-core trains STEPS steps; step SPIKE is a loss spike


def olmo_core_config(d_model: int | None = None):
    """OLMo-core's olmo3_14M shrunk to LAYERS layers (its sliding window pattern, the last layer full), on
    torch's attention (the CPU has no flash attention); `d_model` for a model of another width."""
    from olmo_core.nn.attention import AttentionBackendName
    from olmo_core.nn.transformer import TransformerConfig

    config = TransformerConfig.olmo3_14M(
        vocab_size=VOCAB, n_layers=LAYERS, attn_backend=AttentionBackendName.torch
    )
    return config if d_model is None else dataclasses.replace(config, d_model=d_model)


def olmo_core_train(
    step_dir: Path, config, spike: int | None = SPIKE, stop_one: str | None = None, optim=True
):
    """Train OLMo-core's model STEPS steps with its SkipStepAdamW (embeddings without weight decay, as the
    recipe), FSDP-sharded over the ranks of the process group if there is one, the loss at step `spike` made
    a spike so that the step is skipped; and save the model and (if `optim`) the optimizer with OLMo-core's
    checkpointer in step_dir/model_and_optim, beside the config.json its trainer writes. `stop_one`: that
    parameter gets no gradient in the last step (its Adam count falls behind). Returns what the model and
    optimizer held, whole ({name: {"weight", "exp_avg", "exp_avg_sq", "step"}}), and the steps skipped."""
    import torch
    import torch.distributed as dist
    from olmo_core.distributed.checkpoint import save_model_and_optim_state
    from olmo_core.optim.adamw import SkipStepAdamW
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initial weights on every rank
    model = config.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized():
        for block in model.blocks.values():
            fully_shard(block)
        fully_shard(model)
    params = dict(model.named_parameters())
    groups = [
        {"params": [params["embeddings.weight"]], "weight_decay": 0.0},
        {"params": [p for k, p in params.items() if k != "embeddings.weight"]},
    ]
    opt = SkipStepAdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, rolling_interval_length=8)
    batches = torch.Generator().manual_seed(rank)  # each rank its own batch
    skipped = []
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, VOCAB, (2, 16), generator=batches)
        loss = torch.nn.functional.cross_entropy(
            model(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        if stop_one and step == STEPS:
            params[stop_one].grad = None  # torch's Adam leaves a parameter without a gradient alone
        opt.latest_loss = loss.detach() * (1e6 if step == spike else 1.0)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        opt.latest_grad_norm = whole(norm)
        opt.step()
        skipped += [step] if opt.step_skipped else []
        opt.zero_grad()
    save_model_and_optim_state(step_dir / "model_and_optim", model, opt if optim else None)
    (step_dir / "config.json").write_text(json.dumps({"model": config.as_config_dict()}, default=str))
    held = {
        name: {"weight": whole(p.detach())} | {k: whole(v) for k, v in opt.state[p].items()}
        for name, p in params.items()
    }
    return held, skipped


def whole(t):
    """A tensor whole: an FSDP shard (a DTensor) gathered from every rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def olmo_core_rank(rank: int, port: int, step_dir: Path) -> None:
    """One of two ranks of a gloo process group (the CPU's) training and saving OLMo-core's model FSDP-sharded;
    rank 0 keeps what it held in step_dir's parent directory, reference.pt."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        held, skipped = olmo_core_train(step_dir, olmo_core_config())
        if rank == 0:
            torch.save({"held": held, "skipped": skipped}, step_dir.parent / "reference.pt")
        # The ranks tear down together: once, in a suite, rank 1 left while rank 0 still saved and died in
        # its exit ("terminate called without an active exception", SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()
