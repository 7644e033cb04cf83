"""train.py's recipe against OLMo-core (optimizer, schedule, loss), and the loop end to end."""

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from commands import train_py
from tolerance import FP32, chain, grad_terms, loss_terms, mean_terms, sum_tol

import data
import olmo3
import shard
import train

ROOT = Path(__file__).resolve().parent.parent
SMALL = dataclasses.replace(
    olmo3.MODELS["tiny"],
    vocab_size=256,
    d_model=16,
    n_layers=4,
    n_heads=2,
    n_kv_heads=2,
    head_dim=8,
    mlp_hidden=32,
    sliding_window=4,
)


def test_parse_args_types_and_errors():
    cfg = train.parse_args(
        [
            "--preset",
            "tiny",
            "--steps=12",
            "--lr",
            "0.01",
            "--dry_run",
            "--mesh",
            "fsdp=2",
            "--remat",
            "full",
            "--dtype=bfloat16",
        ]
    )
    assert (cfg.preset, cfg.steps, cfg.lr, cfg.dry_run, cfg.mesh, cfg.seq_len) == (
        "tiny",
        12,
        0.01,
        True,
        "fsdp=2",
        256,
    )
    assert cfg.compute == olmo3.Compute(dtype="bfloat16", attention="auto", remat="full")
    with pytest.raises(train.FlagError, match="unknown flag --stepz; did you mean --steps"):
        train.parse_args(["--stepz", "3"])
    with pytest.raises(train.FlagError, match="--steps 'many': expected int"):
        train.parse_args(["--steps", "many"])
    with pytest.raises(
        train.FlagError, match="--preset 'huge': expected one of tiny, 190m, 1b, 7b, 32b, 7b-midtrain"
    ):
        train.parse_args(["--preset", "huge"])
    with pytest.raises(train.FlagError, match="--eval_only 'maybe': expected true or false"):
        train.parse_args(["--eval_only=maybe"])
    with pytest.raises(
        train.FlagError, match="--attention 'flash': expected one of auto, reference, local, cudnn"
    ):
        train.parse_args(["--attention", "flash"])


def test_7b_preset_is_the_official_stage1_recipe():
    cfg = train.PRESETS["7b"]
    assert cfg.global_batch * cfg.seq_len == 4_194_304
    assert (cfg.lr, cfg.warmup_steps, cfg.lr_final, cfg.seed) == (3e-4, 2000, 0.1, 34521)
    assert cfg.lr_horizon == -(-5 * 10**12 // 4_194_304)
    assert (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.clip, cfg.z_loss) == (
        0.9,
        0.95,
        1e-8,
        0.1,
        1.0,
        1e-5,
    )


def test_lr_schedule_matches_olmo_core():
    from olmo_core.optim.scheduler import CosWithWarmup

    cfg = train.PRESETS["7b"]
    sched = CosWithWarmup(warmup=cfg.warmup_steps, alpha_f=cfg.lr_final, t_max=cfg.lr_horizon)
    for step in [0, 1, 2, 999, 1999, 2000, 2001, 100_000, 597_046, 1_192_092, 1_192_093, 1_413_814]:
        assert train.lr_at(step, cfg) == pytest.approx(sched.get_lr(cfg.lr, step, cfg.lr_horizon), rel=1e-12)
    assert train.lr_at(597_046, cfg) == pytest.approx(1.650e-4, rel=1e-3)  # spec: LR where part 1 stops


@pytest.mark.parametrize("preset", ["7b-midtrain", "32b-midtrain-1", "warmup 100, to 0.1x"])
def test_linear_schedule_matches_olmo_core_linear_with_warmup(preset):
    """OLMo-core's LinearWithWarmup object as the trainer calls it (t_max: the trainer's max_steps), step by
    step through the stage's end, where the last step's LR is 0; and with a warmup and a floor."""
    from olmo_core.optim.scheduler import LinearWithWarmup

    cfg = train.PRESETS.get(preset) or dataclasses.replace(
        train.PRESETS["7b-midtrain"], warmup_steps=100, lr_final=0.1, lr_horizon=1000, steps=1000
    )
    sched = LinearWithWarmup(warmup=cfg.warmup_steps, alpha_f=cfg.lr_final)
    for step in [*range(0, 120), *range(cfg.steps - 5, cfg.steps + 3), cfg.steps // 2, cfg.steps // 3]:
        want = sched.get_lr(cfg.lr, step, cfg.steps)
        assert train.lr_at(step, cfg) == pytest.approx(want, rel=1e-12, abs=1e-18), step
    assert train.lr_at(cfg.steps, cfg) == cfg.lr * cfg.lr_final


def test_7b_midtrain_preset_is_the_official_stage2_recipe():
    """OLMo-core's src/scripts/official/OLMo3/OLMo-3-1025-7B-midtrain.py, field by field."""
    cfg, stage1 = train.PRESETS["7b-midtrain"], train.PRESETS["7b"]
    assert cfg.model_preset == "7b" and cfg.seq_len == 8192 and cfg.global_batch * cfg.seq_len == 2**21
    assert cfg.data == "OLMo-midtraining-mix-0625-100B.txt" and cfg.seed == 1337
    assert (cfg.schedule, cfg.warmup_steps, cfg.lr_final) == ("linear", 0, 0.0)  # LinearWithWarmup(0, 0.0)
    assert cfg.lr == 0.00020712352850360292  # LR, the literal: stage 1's cosine at step 476,838, exactly
    assert cfg.lr == train.lr_at(476_838, stage1)
    assert cfg.lr_horizon == cfg.steps == -(-100_000_000_000 // 2**21)  # Duration.tokens(100B), as max_steps
    assert cfg.repeat_filter == 0  # NumpyFSLDatasetConfig without an instance filter
    same = [f for f in train.RECIPE_FIELDS if f not in ("preset", "data", "global_batch", "seed", "lr")]
    same = [f for f in same if f not in ("schedule", "warmup_steps", "lr_final", "lr_horizon", "steps")]
    assert {f: getattr(cfg, f) for f in same} == {f: getattr(stage1, f) for f in same}  # optimizer, z-loss


def test_32b_midtrain_presets_are_the_official_ingredient_recipes():
    """OLMo-3-1025-32B-midtrain-ingredient-1.py and -2.py: alike but for the mix."""
    one, two, stage1 = (train.PRESETS[p] for p in ("32b-midtrain-1", "32b-midtrain-2", "32b"))
    assert one.model_preset == two.model_preset == "32b" and one.global_batch * one.seq_len == 4 * 1024 * 1024
    assert (one.lr, one.seed, one.schedule, one.warmup_steps, one.lr_final) == (
        0.0002071235285,
        42069,
        "linear",
        0,
        0.0,
    )
    assert one.lr_horizon == one.steps == -(-100_000_000_000 // 2**22)
    assert one.repeat_filter == stage1.repeat_filter == 32  # InstanceFilterConfig(13, 1, 32)
    assert one.data == "OLMo-midtraining-mix-0925-ingredient1-100B.txt"
    assert two.data == "OLMo-midtraining-mix-0925-ingredient2-100B.txt"
    differ = {"preset", "data", "run_dir"}
    assert {k: v for k, v in dataclasses.asdict(one).items() if k not in differ} == {
        k: v for k, v in dataclasses.asdict(two).items() if k not in differ
    }


def test_a_checkpoint_from_before_the_schedule_field_resumes_as_cosine():
    """A stage-1 run saved before --schedule existed trained with the cosine: it resumes, and a linear
    schedule is refused as a change of recipe."""
    import ckpt

    cfg = train.PRESETS["tiny"]
    saved = {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "schedule"}}
    model = ckpt.config_to_hf(train.model_config(cfg))
    saved |= {"model": model, "data": None}
    expected = {"config": dataclasses.asdict(cfg), "model": model, "data": None}
    check = lambda meta, now: ckpt.check_resume(
        train.with_recipe_defaults(meta), now, train.RECIPE_FIELDS, False, "runs/x"
    )
    with pytest.MonkeyPatch.context() as m:
        m.setattr(train.data, "check_fingerprint", lambda a, b: None)
        check(saved, expected)
        linear = {**expected, "config": dataclasses.asdict(dataclasses.replace(cfg, schedule="linear"))}
        with pytest.raises(ckpt.ResumeRefused, match="schedule: 'cosine' -> 'linear'"):
            check(saved, linear)


def test_a_resume_across_a_reduce_dtype_change_is_refused_unless_allowed():
    """--reduce_dtype changes what a bf16 step sums its gradients in: a resume that changes it is another
    recipe (--allow_config_change takes it). A checkpoint from before the flag summed in its compute dtype: a
    bf16 run's resumes as bfloat16 and is refused the new default; an fp32 run's resumes as it was."""
    import ckpt

    bf16 = dataclasses.replace(train.PRESETS["tiny"], compute=olmo3.Compute("bfloat16"))
    model = ckpt.config_to_hf(train.model_config(bf16))
    meta = lambda cfg: {"config": dataclasses.asdict(cfg), "model": model, "data": None}
    before = lambda cfg: {
        **meta(cfg),
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "reduce_dtype"},
    }
    check = lambda saved, now, allow=False: ckpt.check_resume(
        train.with_recipe_defaults(saved), now, train.RECIPE_FIELDS, allow, "runs/x"
    )
    narrow = dataclasses.replace(bf16, reduce_dtype="bfloat16")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(train.data, "check_fingerprint", lambda a, b: None)
        with pytest.raises(ckpt.ResumeRefused, match="reduce_dtype: 'float32' -> 'bfloat16'"):
            check(meta(bf16), meta(narrow))
        check(meta(bf16), meta(narrow), allow=True)
        with pytest.raises(ckpt.ResumeRefused, match="reduce_dtype: 'bfloat16' -> 'float32'"):
            check(before(bf16), meta(bf16))
        check(before(bf16), meta(narrow))
        check(before(train.PRESETS["tiny"]), meta(train.PRESETS["tiny"]))


@pytest.mark.parametrize("path,chunk", [("fused", 0), ("fused", 8), ("reference", 0)])
def test_lm_head_loss_and_gradients_match_olmo_core(path, chunk):
    """Loss, z-loss and their gradients with respect to the features and the LM head, both paths, against
    OLMo-core's cross_entropy_loss differentiated by torch autograd."""
    from olmo_core.data.utils import get_labels
    from olmo_core.nn.functional import cross_entropy_loss

    rng = np.random.default_rng(0)
    batch, seq, d, vocab, z_loss = 3, 16, 8, 128, 1e-2  # a large z-loss, so its gradient shows
    x = rng.standard_normal((batch, seq, d)).astype(np.float32)
    w = rng.standard_normal((d, vocab)).astype(np.float32)
    tokens = rng.integers(0, vocab, (batch, seq))
    labels = get_labels({"input_ids": torch.as_tensor(tokens)})
    n = int((labels != -100).sum())
    tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
    ce, z = cross_entropy_loss(
        (tx @ tw).view(-1, vocab),
        labels.view(-1),
        reduction="sum",
        compute_z_loss=True,
        z_loss_multiplier=z_loss,
    )
    ((ce + z) / n).backward()

    def loss(x, w):
        targets = jnp.roll(jnp.asarray(tokens), -1, axis=-1)
        mask = train.targeted(jnp.ones(batch, bool), jnp.ones((batch, seq), bool))
        if path == "fused":
            scale = jnp.float32(1 / n)
            total, (ce, zz) = olmo3.fused_lm_head(
                x, w, train.loss_sums, targets, mask, (scale, scale * z_loss), chunk
            )
            ce, zz = jax.lax.stop_gradient((ce, zz))
        else:
            ce, zz = train.loss_sums(olmo3.linear(x, w, out_dtype=jnp.float32), targets, mask)
            total = (ce + z_loss * zz) / n
        return total, (ce / n, z_loss * zz / n)

    (total, (ours_ce, ours_z)), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        jnp.asarray(x), jnp.asarray(w)
    )
    assert n == batch * (seq - 1)
    # fp32 rounding: a logit's d products, the softmax over the vocabulary, the mean over the n tokens
    rel = sum_tol(mean_terms(chain(d, np.sqrt(vocab)), n))
    assert float(ours_ce) == pytest.approx(ce.item() / n, rel=rel)
    assert float(ours_z) == pytest.approx(z.item() / n, rel=rel)
    # and then dx's sum over the vocabulary and dw's over the tokens, of either sign: their worst cases
    for ours, theirs, terms in [(dx, tx.grad, vocab), (dw, tw.grad, n)]:
        tol = sum_tol(chain(d, np.sqrt(vocab), terms), np.abs(theirs.numpy()).max())
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=tol)


@pytest.mark.parametrize("path", ["fused", "reference"])
def test_bf16_logits_as_olmo_core_s_lm_head_makes_them_under_its_bf16_policy(path):
    """In bf16, OLMo-core's LM head (bf16 parameters under its FSDP policy) emits bf16 logits, which its
    cross_entropy_loss upcasts: our loss in bf16 is the loss of those logits, not of fp32 ones made from the
    same bf16 features and weights (which differ from OLMo-core's by the logits' rounding)."""
    from olmo_core.nn.functional import cross_entropy_loss

    rng = np.random.default_rng(0)
    batch, seq, d, vocab = 2, 16, 64, 256
    x = jnp.asarray(rng.standard_normal((batch, seq, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((d, vocab)) / 8, jnp.bfloat16)
    tokens = rng.integers(0, vocab, (batch, seq))
    targets, mask = (
        jnp.roll(jnp.asarray(tokens), -1, axis=-1),
        train.targeted(jnp.ones(batch, bool), jnp.ones((batch, seq), bool)),
    )
    as_torch = lambda a: torch.as_tensor(np.asarray(a.astype(jnp.float32))).bfloat16()
    logits = (as_torch(x) @ as_torch(w)).view(-1, vocab)  # bf16, as F.linear with bf16 parameters
    labels = torch.as_tensor(np.where(np.asarray(mask), np.asarray(targets), -100)).long().view(-1)
    want, want_z = cross_entropy_loss(
        logits, labels, reduction="sum", compute_z_loss=True, z_loss_multiplier=1
    )
    if path == "fused":
        (ce, zz), _, _ = olmo3.lm_head_sums(x, w, train.loss_sums, targets, mask, 8)
    else:
        ce, zz = train.loss_sums(olmo3.linear(x, w, out_dtype=x.dtype), targets, mask)
    fp32, _ = train.loss_sums(olmo3.linear(x, w, out_dtype=jnp.float32), targets, mask)
    apart = abs(float(fp32) - want.item())
    assert apart > 2e-5 * want.item()  # the logits' rounding shows in the loss
    assert abs(float(ce) - want.item()) < apart / 20 and float(zz) == pytest.approx(want_z.item(), rel=1e-5)


def test_fused_and_reference_losses_agree_through_the_model():
    """The loss_fn of each path (--loss fused / reference) inside the model: the same loss and gradients, and
    both the same as autodiff of the model's own logits."""
    model = olmo3.Olmo3(SMALL, key=jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)))
    fused = dataclasses.replace(train.PRESETS["tiny"], z_loss=1e-2, loss_chunk=8)

    def plain(model):
        ce, lse = train.cross_entropy(model(tokens), jnp.roll(tokens, -1, axis=-1))
        return (ce[:, :-1].sum() + fused.z_loss * (lse[:, :-1] ** 2).sum()) / 62

    want, want_grads = eqx.filter_value_and_grad(plain)(model)
    for cfg in (fused, dataclasses.replace(fused, loss="reference")):
        keep = jnp.ones(2, bool)
        (loss, _), grads = eqx.filter_value_and_grad(train.loss_fn, has_aux=True)(
            model, tokens, keep, jnp.full(2, 1 / 62, jnp.float32), cfg
        )
        # fp32 rounding through SMALL's sums over 2 rows of 32 tokens (62 targets)
        np.testing.assert_allclose(loss, want, rtol=sum_tol(loss_terms(SMALL, 32, 62)))
        for ours, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            tol = sum_tol(grad_terms(SMALL, 32, 64), jnp.abs(ref).max())
            np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)


def test_dropped_instances_count_as_olmo_core_s_train_module_counts_them():
    """Rows the repeat filter drops: no loss and no gradient, and the mean divided as OLMo-core's train module
    divides it (its labels from get_labels with the instance mask, plus each dropped instance's tokens)."""
    from olmo_core.data.utils import get_labels
    from olmo_core.nn.functional import cross_entropy_loss

    cfg = dataclasses.replace(train.PRESETS["tiny"], z_loss=1e-2, global_batch=4, seq_len=32)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 32))
    keep = np.array([True, False, True, False])
    model = olmo3.Olmo3(SMALL, key=jax.random.key(0))
    labels = get_labels({"input_ids": torch.as_tensor(tokens), "instance_mask": torch.as_tensor(keep)})
    logits = torch.as_tensor(np.array(model(jnp.asarray(tokens)))).view(-1, SMALL.padded_vocab)
    ce, z = cross_entropy_loss(
        logits, labels.view(-1), reduction="sum", compute_z_loss=True, z_loss_multiplier=1e-2
    )
    divisor = (labels != -100).sum() + (~torch.as_tensor(keep)).sum() * labels.shape[1]
    results = []
    for n_micro, rows in [(1, tokens), (2, tokens), (1, np.where(keep[:, None], tokens, 7))]:
        m = olmo3.Olmo3(SMALL, key=jax.random.key(0))
        opt = train.init_opt(eqx.filter(m, eqx.is_array), cfg)
        m, opt, metrics = train.train_step(
            m,
            opt,
            jnp.asarray(rows, jnp.int32),
            jnp.float32(1e-3),
            cfg=cfg,
            n_micro=n_micro,
            keep=jnp.asarray(keep),
        )
        rel = sum_tol(loss_terms(SMALL, 32, 2 * 31))  # fp32 rounding over the 2 kept rows' targets
        assert float(metrics["ce_loss"]) == pytest.approx((ce / divisor).item(), rel=rel)
        assert float(metrics["z_loss"]) == pytest.approx((z / divisor).item(), rel=rel)
        results.append(np.asarray(opt.mu.lm_head))
    # The dropped rows' tokens changed (third run): the same gradient, so they contributed nothing.
    np.testing.assert_allclose(results[2], results[0], rtol=1e-5, atol=1e-9)


class MetricsOf:
    """What an OLMo-core train module reports to its trainer, kept: a stand-in for the Trainer it needs."""

    def __init__(self):
        self.ce = []

    def record_metric(self, *args, **kwargs):
        pass

    def record_ce_loss(self, value, reduce_type=None):
        self.ce.append(float(value))


def olmo_core_ranks(weights: dict, tokens: np.ndarray, keep: np.ndarray, ranks: int):
    """OLMo-core's TransformerTrainModule.train_batch run as each of `ranks` data-parallel ranks on its rows
    of one global batch (rows r, r + ranks, ..., as its loader strides them), from `weights` (by its names);
    its ranks' losses and gradients averaged as FSDP's all-reduce (AVG) averages them: (CE loss, gradients)."""
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core_runs import olmo_core_config

    rows, seq = tokens.shape
    model = olmo_core_config().build(init_device="cpu")
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=rows // ranks * seq,
        max_sequence_length=seq,
        optim=AdamWConfig(lr=0.0),
        z_loss_multiplier=1e-2,
    ).build(model, device=torch.device("cpu"))
    model.load_state_dict({k: torch.as_tensor(v.copy()) for k, v in weights.items()})  # once it has its own
    metrics = MetricsOf()
    module._attach_trainer(metrics)
    for r in range(ranks):  # each rank's backward adds its gradient to the parameters'
        rank_rows = {"input_ids": tokens[r::ranks], "instance_mask": keep[r::ranks]}
        module.train_batch({k: torch.as_tensor(v) for k, v in rank_rows.items()})
    return np.mean(metrics.ce), {k: p.grad.numpy() / ranks for k, p in model.named_parameters()}


def test_loss_is_weighted_per_rank_as_olmo_core_s_train_module_weighs_it_on_several_ranks(monkeypatch):
    """With instances dropped on one of 4 ranks only, OLMo-core's per-rank loss (olmo_core_ranks) and our
    train step with --dp_ranks 4 on the whole batch: the same loss and gradient. One global count
    (--dp_ranks 1) is not."""
    from test_olmo_core_ckpt import olmo_core_layout, our_config

    ranks, rows, seq = 4, 8, 16
    monkeypatch.setitem(olmo3.MODELS, "olmo-core-14m", our_config())
    mcfg = olmo3.MODELS["olmo-core-14m"]
    tokens = np.random.default_rng(0).integers(0, 256, (rows, seq))
    keep = np.array([True, False, True, True, True, False, True, True])  # rows 1 and 5: both rank 1's
    model = lambda: olmo3.Olmo3(mcfg, key=jax.random.key(0))  # a fresh one for each step (it is donated)
    want_ce, want_grads = olmo_core_ranks(olmo_core_layout(model(), mcfg), tokens, keep, ranks)
    for dp_ranks in (ranks, 1):
        cfg = dataclasses.replace(
            train.PRESETS["tiny"],
            preset="olmo-core-14m",
            z_loss=1e-2,
            global_batch=rows,
            seq_len=seq,
            dp_ranks=dp_ranks,
            clip=1e9,
        )
        opt = train.init_opt(eqx.filter(model(), eqx.is_array), cfg)
        batch, lr = jnp.asarray(tokens, jnp.int32), jnp.float32(0)
        _, opt, m = train.train_step(model(), opt, batch, lr, cfg=cfg, n_micro=2, keep=jnp.asarray(keep))
        grads = olmo_core_layout(jax.tree.map(lambda mu: mu / (1 - cfg.beta1), opt.mu), mcfg)
        if (
            dp_ranks == 1
        ):  # the kept rows' sum over 8 x 15 + 2, where OLMo-core averages rank sums over 30, 32
            assert abs(float(m["ce_loss"]) / want_ce - 1) > 1e-3
            continue
        # fp32 rounding, in other orders on the two sides: the model's sums, the kept tokens' (6 rows of 15
        # targets) in the loss, every token's in a weight's gradient
        assert float(m["ce_loss"]) == pytest.approx(want_ce, rel=sum_tol(loss_terms(mcfg, seq, 6 * 15)))
        for k, g in want_grads.items():
            tol = sum_tol(grad_terms(mcfg, seq, rows * seq), np.abs(g).max())
            np.testing.assert_allclose(grads[k], g, rtol=0, atol=tol, err_msg=k)


def test_32b_preset_is_the_official_recipe():
    """OLMo-core's src/scripts/official/OLMo3/OLMo-3-1025-32B-pretrain.py, field by field."""
    cfg, seven = train.PRESETS["32b"], train.PRESETS["7b"]
    assert cfg.global_batch * cfg.seq_len == 8 * 1024 * 1024 and cfg.seq_len == 8192  # GLOBAL_BATCH_SIZE
    assert (cfg.lr, cfg.warmup_steps, cfg.lr_final, cfg.seed) == (6e-4, 2000, 0.1, 34521)  # LR, CosWithWarmup
    assert cfg.data == "OLMo-mix-0925-official.txt"  # DataMix.OLMo_mix_0925_official
    # One epoch of the mix (max_duration=Duration.epochs(1)), computed from the data at the start.
    assert cfg.lr_horizon == cfg.steps == 0
    assert (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.clip, cfg.z_loss) == (
        0.9,
        0.95,
        1e-8,
        0.1,
        1.0,
        1e-5,
    )
    assert (cfg.skip_window, cfg.skip_sigma) == (128, 6.0)  # SkipStepAdamWConfig's defaults
    assert cfg.repeat_filter == 32 and data.REPEAT_PERIODS == (1, 13)  # InstanceFilterConfig(13, 1, 32)
    assert seven.repeat_filter == 0  # the 7B relies on the skip-step optimizer instead


def test_one_epoch_is_olmo_core_s_max_steps_for_one_epoch_of_the_data(tiny_data, tmp_path):
    """--lr_horizon 0 and --steps 0 become the number of batches OLMo-core's data loader gives one epoch of the
    same files (Duration.epochs(1): the trainer's max_steps, which CosWithWarmup's t_max is)."""
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig

    files = data.prepare_tiny(str(tiny_data))["train"]
    cfg = dataclasses.replace(
        train.PRESETS["tiny"], data="tiny", data_root=str(tiny_data), global_batch=3, seq_len=200
    )
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "run"), lr_horizon=0, steps=0)
    run = train.plan_run(cfg, shard.make_mesh(cfg.mesh), train.model_config(cfg), None)
    tokenizer = TokenizerConfig(vocab_size=8192, eos_token_id=0, pad_token_id=0)
    dataset = NumpyFSLDatasetConfig(
        paths=files, sequence_length=200, tokenizer=tokenizer, work_dir=str(tmp_path / "oc")
    ).build()
    loader = NumpyDataLoaderConfig(global_batch_size=3 * 200, seed=cfg.seed, work_dir=str(tmp_path / "oc"))
    epoch = loader.build(dataset).total_batches
    assert run.cfg.lr_horizon == run.cfg.steps == epoch > 100
    assert run.meta["config"]["lr_horizon"] == epoch  # recorded: a resume on other data is refused
    assert train.lr_at(epoch, run.cfg) == cfg.lr * cfg.lr_final
    partly = dataclasses.replace(cfg, steps=5)  # one epoch's cosine, stopped early (as AI2's 32B stage 1)
    assert train.one_epoch_where_asked(partly, epoch) == dataclasses.replace(partly, lr_horizon=epoch)


def olmo_core_optimizer(params: dict[str, np.ndarray], cfg):
    from olmo_core.optim.adamw import SkipStepAdamW

    torch_params = {k: torch.nn.Parameter(torch.as_tensor(v.copy())) for k, v in params.items()}
    groups = [
        {"params": [torch_params["embed_tokens"]], "weight_decay": 0.0},
        {"params": [p for k, p in torch_params.items() if k != "embed_tokens"]},
    ]
    opt = SkipStepAdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        rolling_interval_length=cfg.skip_window,
        sigma_factor=int(cfg.skip_sigma),
        foreach=True,
    )
    return torch_params, opt


def leaves(model) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(p).strip(".").replace(".", "/"): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
    }


@pytest.mark.parametrize("skip_window", [128, 8])
def test_optimizer_matches_olmo_core_skip_step_adamw(skip_window):
    """Same gradients in, same parameters out, over 80 steps that cover warmup of the skip rule,
    weight-decay exclusion of the embeddings, clipping, and forced skips on a loss and a grad-norm spike;
    with the recipe's window of 128 steps, and with one of 8 whose history wraps around ten times."""
    cfg = dataclasses.replace(train.PRESETS["7b"], lr=1e-2, skip_window=skip_window)
    model = olmo3.Olmo3(SMALL, key=jax.random.key(0))
    names = leaves(model)
    names = {("embed_tokens" if k == "embed_tokens" else k): v for k, v in names.items()}
    torch_params, torch_opt = olmo_core_optimizer(names, cfg)
    params = eqx.filter(model, eqx.is_array)
    opt = train.init_opt(params, cfg)
    step = jax.jit(lambda p, g, o, lr, loss, gn: train.optimizer_step(p, g, o, lr, loss, gn, cfg))
    rng = np.random.default_rng(0)
    skipped = []
    for k in range(1, 81):
        scale = 100.0 if k == 75 else (0.05 if k % 3 else 3.0)  # some clipped, one grad-norm spike
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32) * scale), params
        )
        loss = 3.0 + 0.01 * rng.standard_normal() + (5.0 if k == 70 else 0.0)  # a loss spike
        lr = train.lr_at(k, dataclasses.replace(cfg, warmup_steps=10, lr_horizon=80))
        grad_norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
        params, opt, skip = step(
            params, grads, opt, jnp.float32(lr), jnp.float32(loss), jnp.float32(grad_norm)
        )
        skipped.append(bool(skip))

        for name, g in leaves(grads).items():
            torch_params[name].grad = torch.as_tensor(g.copy())
        total = torch.nn.utils.get_total_norm([p.grad for p in torch_params.values()])
        torch.nn.utils.clip_grads_with_norm_(list(torch_params.values()), cfg.clip, total)
        torch_opt.latest_grad_norm = total
        torch_opt.latest_loss = torch.tensor(loss, dtype=torch.float32)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        assert bool(torch_opt.step_skipped) == skipped[-1], f"step {k}"
    skips = [k + 1 for k, s in enumerate(skipped) if s]
    assert skips == [70, 75] if skip_window == 128 else {70, 75} <= set(skips)
    # Each step rounds a parameter's sum with its update (an ulp of the parameter) and the update: lr times
    # m / sqrt(v), off by the clip factor's rounding (a norm over every gradient's square: sqrt(n) of one sign)
    # and some ten more roundings. The 80 steps round independently: sqrt(80) of them.
    n = sum(p.size for p in jax.tree.leaves(params))
    for name, ours in leaves(params).items():
        np.testing.assert_allclose(
            ours,
            torch_params[name].detach().numpy(),
            rtol=np.sqrt(80) * FP32,
            atol=np.sqrt(80) * sum_tol(np.sqrt(n) + 10, cfg.lr),
            err_msg=name,
        )
    assert int(opt.count) == 80 - len(skips) == int(torch_opt.state[torch_params["norm"]]["step"])


def test_skipped_step_leaves_everything_untouched():
    cfg = train.PRESETS["tiny"]
    params = eqx.filter(olmo3.Olmo3(SMALL, key=jax.random.key(0)), eqx.is_array)
    opt = train.init_opt(params, cfg)
    opt = dataclasses.replace(
        opt,
        losses=opt.losses.at[:100].set(3.0 + 0.01 * jnp.sin(jnp.arange(100.0))),
        grad_norms=opt.grad_norms.at[:100].set(1.0),
        seen=jnp.int32(100),
    )
    grads = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan), params)  # a NaN never leaks in
    new, new_opt, skip = train.optimizer_step(
        params, grads, opt, 1e-3, jnp.float32(jnp.nan), jnp.float32(jnp.nan), cfg
    )
    assert bool(skip)
    assert all((a == b).all() for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)))
    assert float(new_opt.count) == 0 and all(
        float(jnp.abs(m).max()) == 0 for m in jax.tree.leaves(new_opt.mu)
    )
    assert int(new_opt.seen) == 101  # the window still records the step


def test_gradient_accumulation_gives_the_same_update():
    cfg = dataclasses.replace(train.PRESETS["tiny"], global_batch=8, seq_len=16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 16)), jnp.int32)
    results = []
    for n_micro in (1, 4):
        model = olmo3.Olmo3(SMALL, key=jax.random.key(0))
        opt = train.init_opt(eqx.filter(model, eqx.is_array), cfg)
        model, opt, metrics = train.train_step(
            model, opt, tokens, jnp.float32(1e-3), cfg=cfg, n_micro=n_micro
        )
        results.append((model, opt, metrics))
    (m1, o1, r1), (m4, o4, r4) = results
    # fp32 rounding: SMALL's sums, and over 8 rows of 16 tokens summed in 1 or in 4 microbatches
    np.testing.assert_allclose(r4["loss"], r1["loss"], rtol=sum_tol(loss_terms(SMALL, 16, 8 * 15)))
    np.testing.assert_allclose(r4["grad_norm"], r1["grad_norm"], rtol=sum_tol(grad_terms(SMALL, 16, 8 * 16)))
    # After one step the first moment is 0.1 x the (clipped) gradient: the accumulated gradient itself.
    for a, b in zip(jax.tree.leaves(o4.mu), jax.tree.leaves(o1.mu)):
        np.testing.assert_allclose(a, b, rtol=0, atol=sum_tol(grad_terms(SMALL, 16, 8 * 16), np.abs(b).max()))
    # Adam's first step is lr * g / (|g| + eps): where |g| is within ~100 eps its size is set by rounding (a
    # down_proj entry with |g| = 6e-8 moves by 5e-6 between the two), so compare where |g| > 1e-6, to 0.3% of lr.
    updated = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for a, b, mu in zip(updated(m4), updated(m1), jax.tree.leaves(o1.mu)):
        clear = np.abs(np.asarray(mu)) > 1e-7  # mu = 0.1 g
        np.testing.assert_allclose(np.asarray(a)[clear], np.asarray(b)[clear], rtol=0, atol=3e-6)


def test_flops_per_token_counts_sliding_windows_exactly():
    m = olmo3.MODELS["7b"]
    # brute force: count the (query, key) pairs each layer's mask keeps
    seq = 64
    small = dataclasses.replace(m, sliding_window=16, max_seq_len=seq)
    pairs = sum(int(np.asarray(olmo3.causal_mask(seq, small.window(t))).sum()) for t in small.layer_types)
    dense = 6 * (32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 4096 * 100352)
    assert small.flops_per_token(seq) == pytest.approx(dense + 12 * 4096 * pairs / seq, rel=1e-12)
    assert m.attention_pairs(8192, olmo3.SLIDING) == 4096 * 4097 // 2 + 4096 * 4096


def test_peak_table_knows_the_chips():
    class Dev:
        def __init__(self, kind):
            self.device_kind = kind

    assert shard.peak_flops(Dev("NVIDIA H200")) == 989e12
    assert shard.peak_flops(Dev("TPU v5 lite")) == 197e12
    assert shard.peak_flops(Dev("TPU v5p")) == 459e12
    assert shard.peak_flops(Dev("TPU7x")) == 2307e12 / 2  # Ironwood: a chip's two devices share its peak
    assert shard.peak_flops(Dev("cpu")) is None


# ---- the loop end to end, as a user runs it


def run_train(*args, cwd=ROOT, timeout=600):
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_short_tiny_run_end_to_end(tmp_path, tiny_data):
    run = tmp_path / "run"
    out = run_train(
        "--preset",
        "tiny",
        "--seq_len",
        "128",  # half the preset's rows: the same 40 steps in half the suite's time
        "--steps",
        "40",
        "--lr_horizon",
        "40",
        "--warmup_steps",
        "5",
        "--run_dir",
        str(run),
        "--data_root",
        str(tiny_data),
        "--eval_every",
        "20",
        "--ckpt_every",
        "20",
        "--eval_batches",
        "4",
        "--samples",
        "1",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    fields = {
        "step",
        "loss",
        "ce_loss",
        "z_loss",
        "lr",
        "grad_norm",
        "skipped",
        "tokens",
        "tokens_per_s",
        "mfu",
        "data_wait_s",
        "batch_hash",
    }
    assert all(fields <= r.keys() for r in steps)
    assert all("loss" not in r for r in evals) and [r["step"] for r in evals] == [20, 40]
    assert np.mean([r["loss"] for r in steps[-5:]]) < np.mean([r["loss"] for r in steps[:5]]) - 1.0
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert steps[0]["mfu"] is None  # CPU: no MFU
    # Throughput is steady across checkpoints and evals (it once read 1000x around each save).
    rates = [r["tokens_per_s"] for r in steps[1:]]  # the first step carries the compilation
    assert max(rates) < 5 * np.median(rates) and min(rates) > np.median(rates) / 5, rates
    assert (run / "loss.png").stat().st_size > 10_000
    assert json.loads((run / "config.json").read_text())["steps"] == 40
    assert "samples:" in out.stdout and "--- sample 1 ---" in out.stdout
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [20, 40]


BAD_FLAGS = [  # (flags, the one line train.py answers with)
    ("--lr_horizon -1", "--lr_horizon -1: expected an integer >= 0"),
    ("--steps -5", "--steps -5: expected an integer >= 0"),
    ("--seq_len 0", "--seq_len 0: expected an integer >= 2"),
    ("--ckpt_every 0", "--ckpt_every 0: expected an integer >= 1"),
    ("--eval_every 0", "--eval_every 0: expected an integer >= 1"),
    ("--lr -1", "--lr -1.0: expected a number > 0"),
    ("--lr nan", "--lr nan: expected a number > 0"),
    ("--global_batch 0", "--global_batch 0: expected an integer >= 1"),
    ("--keep_last 1", "--keep_last 1: expected an integer >= 2"),
    ("--beta2 1.5", "--beta2 1.5: expected a number >= 0 and <= 1"),
    ("--head_layout abc", "--head_layout 'abc': expected HEADSxHEAD_DIM, e.g. 16x256"),
    (
        "--head_layout 3x100",
        "--head_layout 3x100: 3 heads x head_dim 100: expected heads x head_dim = 256 (n_heads x head_dim), "
        "heads a multiple of 1",
    ),
    ("--loss_chunk 7", "--loss_chunk 7: expected a divisor of --seq_len 256 (or 0)"),
    ("--loss flash", "--loss 'flash': expected one of fused, reference"),
    ("--schedule step", "--schedule 'step': expected one of cosine, linear"),
    ("--reduce_dtype float16", "--reduce_dtype 'float16': expected one of float32, bfloat16"),
    (
        "--reduce_dtype bfloat16",
        "--reduce_dtype bfloat16: gradients summed narrower than --dtype float32 makes them; expected float32",
    ),
    ("--model 70b", "--model '70b': expected one of tiny, 190m, 1b, 7b, 32b"),
    ("--remat some", "--remat 'some': expected one of auto, none, full, save_matmuls, save_attention"),
    ("--mesh fsdp=two", "--mesh 'fsdp=two': expected entries like data=2,fsdp=-1,context=1,tensor=1"),
    ("--topology v5p-512", "--topology v5p-512: devices that exist only for the compiler; add --dry_run"),
    ("--dry_run --eval_only", "--dry_run and --eval_only: choose one"),
    (
        "--init_from_hf /nowhere",
        "--init_from_hf is retired; use --init_from HF_DIR (it takes our run directories",
    ),
    ("--init_weights_only", "--init_weights_only: goes with --init_from SOURCE"),
    ("--tensorboard", "--tensorboard needs tensorboardX: pip install -e '.[tensorboard]'"),
    ("--steps=many", "--steps 'many': expected int"),
    ("--ckpt_evry 5", "unknown flag --ckpt_evry; did you mean --ckpt_every"),
]


@pytest.mark.parametrize("flags,error", BAD_FLAGS)
def test_bad_flags_are_refused_naming_the_flag_the_value_and_what_is_accepted(flags, error):
    with pytest.raises(train.FlagError) as e:
        train.check_flags(train.parse_args(["--preset", "tiny", *flags.split()]))
    assert str(e.value).startswith(error), str(e.value)


def test_bad_flags_exit_2_at_once_in_one_line_and_write_nothing(tmp_path):
    for flags, error in [
        ("--ckpt_every 0", BAD_FLAGS[3][1]),
        (
            "--global_batch 6 --mesh fsdp=4",
            "--global_batch 6: expected a multiple of the 4 data x fsdp devices",
        ),
    ]:
        t0 = time.time()
        out = run_train("--preset", "tiny", "--run_dir", str(tmp_path / "run"), *flags.split())
        assert out.returncode == 2 and time.time() - t0 < 30, out.stderr[-2000:]  # before anything compiles
        assert out.stderr.strip().startswith(f"error: {error}") and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_help_lists_every_flag_with_its_default_and_comment():
    out = run_train("--help")
    assert out.returncode == 0 and run_train("-h").stdout == out.stdout
    for name, (_, comment) in train.flags().items():
        line = next(line for line in out.stdout.splitlines() if line.startswith(f"  --{name} "))
        assert comment in line, line
    assert "--lr                   0.0003         peak learning rate" in out.stdout
    assert "--remat                'auto'" in out.stdout


def test_help_shows_the_chosen_preset_s_values(capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--preset", "tiny", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "Flags and the tiny preset's values:" in out
    assert "--seq_len              256  " in out and "--lr                   0.002  " in out, out


@dataclasses.dataclass
class Commented:
    short: int = 1  # said on one line
    long: int = 2  # said on this line
    # and continued on the next
    plain: int = 3

    # a heading for the fields below, not a comment of `plain`
    last: str = "x"  # the last


def test_a_comment_continued_on_the_next_line_is_whole_in_help():
    assert train.field_comments(Commented) == {
        "short": "said on one line",
        "long": "said on this line and continued on the next",
        "last": "the last",
    }


def test_a_refused_value_is_named_by_its_flag_whatever_form_the_message_takes(monkeypatch):
    def refuse(self):  # olmo3.Compute speaking of its own field, without train.py's "--"
        if self.attention == "flash":
            raise ValueError("attention 'flash': expected one of auto, reference")

    monkeypatch.setattr(olmo3.Compute, "__post_init__", refuse)
    with pytest.raises(train.FlagError) as e:
        train.parse_args(["--attention", "flash"])
    assert str(e.value) == "--attention 'flash': expected one of auto, reference"


def test_train_step_traces_once(tiny_data, tmp_path, monkeypatch):
    """Six steps, a checkpoint and an evaluation between them: the step is traced once (rows of 64, one
    evaluation batch: what is counted does not depend on the sizes)."""
    traces = []
    real = train.loss_fn
    monkeypatch.setattr(train, "loss_fn", lambda *a: traces.append(1) or real(*a))
    cfg = dataclasses.replace(
        train.PRESETS["tiny"],
        seq_len=64,
        global_batch=4,
        eval_batches=1,
        steps=6,
        data_root=str(tiny_data),
        run_dir=str(tmp_path),
        eval_every=3,
        ckpt_every=3,
        samples=0,
    )
    assert train.main(cfg) == 0
    assert len(traces) == 1


def test_the_repeat_filter_logs_what_it_drops_and_hashes_what_it_read(tiny_data, tmp_path):
    tokens = np.fromfile(tiny_data / "train" / "part-00000.npy", np.uint16)[: 64 * 200].copy()
    for start in range(0, len(tokens) - 64, 300):  # a token repeated 40 times every 300 tokens
        tokens[start : start + 40] = 17
    tokens.tofile(tmp_path / "repeats.npy")
    cfg = dataclasses.replace(
        train.PRESETS["tiny"],
        data=str(tmp_path / "repeats.npy"),
        seq_len=64,
        steps=4,
        run_dir=str(tmp_path / "run"),
        eval_every=100,
        ckpt_every=100,
        samples=0,
        repeat_filter=32,
    )
    assert train.main(cfg) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    loader = data.TokenLoader([tmp_path / "repeats.npy"], 64, 8, seed=cfg.seed, dtype=np.uint16)
    batches = [loader.global_batch(i) for i in range(4)]
    assert [r["filtered"] for r in rows] == [int(data.repeated(b, 32).sum()) for b in batches]
    assert sum(r["filtered"] for r in rows) > 0
    assert [r["batch_hash"] for r in rows] == [data.format_hash(data.batch_hash(b)) for b in batches]


@pytest.mark.slow
def test_init_from_a_hugging_face_directory_starts_from_those_weights(tmp_path, tiny_data):
    from transformers import Olmo3ForCausalLM

    import ckpt
    import data

    ckpt.save_hf(olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(42)), tmp_path / "hf")
    start = ["--preset", "tiny", "--steps", "1", "--samples", "0", "--data_root", tiny_data]
    out = train_py(
        [*start, "--run_dir", tmp_path / "run", "--init_from", tmp_path / "hf", "--eval_every", "100"]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        f"starting from {tmp_path / 'hf'} (hf: weights only: Adam from zero); this process read" in out.stdout
    )
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # transformers' loss of those weights on batch 0 of the data order is the first step's CE.
    prepared = data.prepare_tiny(str(tiny_data))
    cfg = train.PRESETS["tiny"]
    batch = data.TokenLoader(
        prepared["train"], cfg.seq_len, cfg.global_batch, seed=cfg.seed, dtype=np.uint16
    ).global_batch(0)
    hf = Olmo3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.as_tensor(batch.astype(np.int64))
    with torch.no_grad():
        expected = hf(input_ids=ids, labels=ids).loss.item()
    # fp32 rounding through the tiny model's sums, over the batch's targets
    targets = cfg.global_batch * (cfg.seq_len - 1)
    assert first["ce_loss"] == pytest.approx(
        expected, rel=sum_tol(loss_terms(olmo3.MODELS["tiny"], cfg.seq_len, targets))
    )

    other = dataclasses.replace(
        olmo3.MODELS["tiny"], n_layers=8, layer_types=olmo3.MODELS["tiny"].layer_types * 2
    )
    ckpt.save_hf(olmo3.Olmo3(other, key=jax.random.key(0)), tmp_path / "hf8")
    out = train_py([*start, "--run_dir", tmp_path / "run8", "--init_from", tmp_path / "hf8"])
    # Refused as bad usage, in one line, before anything is compiled or the run directory is made.
    said = f"error: --init_from {tmp_path / 'hf8'}: {tmp_path / 'hf8'} holds another model than the run's: "
    assert out.returncode == 2 and out.stderr.startswith(said), out.stderr[-3000:]
    assert "num_hidden_layers 8 vs 4, layer_types 8 entries vs [" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "run8").exists()


def test_a_nan_stops_the_run_naming_the_last_checkpoint_there_is(tmp_path):
    import types

    import ckpt

    saved = ckpt.Checkpoints(tmp_path)
    saved.save(7, olmo3.Olmo3(SMALL, key=jax.random.key(0)))
    saved.close()
    run = types.SimpleNamespace(checkpoints=ckpt.Checkpoints(tmp_path, read_only=True))
    nan = {"loss": jnp.float32(jnp.nan), "grad_norm": jnp.float32(1.0)}
    with pytest.raises(
        FloatingPointError, match=f"step 9: loss nan, .*the last checkpoint is {tmp_path}/checkpoints/7"
    ):
        train.log_step(run, 9, nan, train.Batch(None, {}, 0, 0), None)
    empty = types.SimpleNamespace(checkpoints=ckpt.Checkpoints(tmp_path / "new"))
    with pytest.raises(FloatingPointError, match=r"\(no checkpoint yet\)"):
        train.log_step(empty, 3, nan, train.Batch(None, {}, 0, 0), None)


def test_tokens_per_s_is_the_rate_of_the_steps_it_covers_across_saves_evals_and_a_resume(
    tiny_data, tmp_path, monkeypatch
):
    """Against the wall clock: the seconds each row accounts for (tokens / tokens_per_s) add up to the time
    the run spent stepping (saves and evaluations left out), and no row is off by more than a few times
    from the others (it read 1000x too high right after each save: the first step after it looked free)."""
    calls = {}  # (start, end) of each call of these, this run

    def timed(name):
        fn = getattr(train, name)

        def wrapped(*args):
            start = time.perf_counter()
            out = fn(*args)
            calls.setdefault(name, []).append((start, time.perf_counter()))
            return out

        monkeypatch.setattr(train, name, wrapped)

    for name in ("take_step", "log_step", "save", "evaluate"):
        timed(name)
    cfg = dataclasses.replace(
        train.PRESETS["tiny"],
        seq_len=64,
        steps=6,
        data_root=str(tiny_data),
        run_dir=str(tmp_path / "run"),
        ckpt_every=2,
        eval_every=3,
        eval_batches=1,
        samples=0,
    )
    for start, steps in ((0, 6), (6, 12)):  # then resumed from step 6
        calls.clear()
        assert train.main(dataclasses.replace(cfg, steps=steps, allow_config_change=True)) == 0
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        rows = [r for r in map(json.loads, lines) if "loss" in r and r["step"] > start]
        paused = sum(end - begin for name in ("save", "evaluate") for begin, end in calls[name])
        stepping = calls["log_step"][-1][1] - calls["take_step"][0][0] - paused
        accounted = sum(64 * 8 / r["tokens_per_s"] for r in rows)
        assert 0.6 * stepping < accounted < 1.3 * stepping, (accounted, stepping, rows)
        rates = [r["tokens_per_s"] for r in rows[1:]]  # the first step's carries the compilation
        assert max(rates) < 4 * np.median(rates) and min(rates) > np.median(rates) / 4, rates


@pytest.mark.parametrize("ckpt_every", [2, 100], ids=["a-save-step", "not-a-save-step"])
def test_an_evaluation_that_fails_keeps_its_step(ckpt_every, tiny_data, tmp_path, monkeypatch):
    """The step is saved before the evaluation's error stops the run, whether or not it was due a save."""
    import ckpt

    def fail(run, step, model):
        raise data.DataError(f"step {step}: the held-out data is bad")

    monkeypatch.setattr(train, "evaluate", fail)
    cfg = dataclasses.replace(
        train.PRESETS["tiny"],
        seq_len=64,
        steps=4,
        data_root=str(tiny_data),
        run_dir=str(tmp_path / "run"),
        ckpt_every=ckpt_every,
        eval_every=2,
        samples=0,
    )
    with pytest.raises(data.DataError, match="step 2: the held-out data is bad"):
        train.main(cfg)
    assert ckpt.Checkpoints(tmp_path / "run", read_only=True).steps() == [2]


def refused(capsys, *argv) -> str:
    """train.py's one line for a command refused as bad usage (exit 2)."""
    assert train.cli(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_eval_only_on_a_run_directory_without_a_checkpoint_is_refused_and_creates_nothing(
    tiny_data, tmp_path, capsys
):
    typo = tmp_path / "rnu"
    err = refused(
        capsys, "--preset", "tiny", "--eval_only", "--run_dir", str(typo), "--data_root", str(tiny_data)
    )
    assert err == (
        f"error: --eval_only: --run_dir {typo} holds no checkpoint to evaluate; expected the directory of a run "
        "that saved one (or --init_from)"
    )
    assert not typo.exists()


def test_eval_only_without_held_out_data_says_so_first(tiny_data, tmp_path, capsys):
    train_file = str(tiny_data / "train" / "part-00000.npy")
    argv = ["--preset", "tiny", "--data", train_file, "--eval_only", "--steps", "1000000"]
    err = refused(capsys, *argv, "--run_dir", str(tmp_path / "run"))
    assert err == "error: --eval_only needs held-out data or tasks: set --eval_data or --tasks"


def test_a_run_refused_before_it_starts_leaves_no_run_directory(tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [
        "--preset",
        "tiny",
        "--data_root",
        str(tiny_data),
        "--steps",
        "1000000",
        "--run_dir",
        str(run_dir),
    ]
    assert refused(capsys, *argv).startswith("error: --steps 1000000: the data holds ")
    assert not run_dir.exists()


def test_every_preset_is_within_what_its_fields_accept():
    """The presets are checked as a user's flags are (train.check_fields: the bounds and choices flag() gives
    each field): a preset edited out of bounds fails here, not in the middle of a run."""
    for preset in train.PRESETS.values():
        train.check_fields(preset)
    with pytest.raises(train.FlagError, match=r"^--lr 0.0: expected a number > 0$"):
        train.check_fields(dataclasses.replace(train.PRESETS["tiny"], lr=0.0))
