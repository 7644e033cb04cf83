"""Stage 3 (long context): the packed step's loss and gradients against transformers' Olmo3 running each
document alone (what document masking means), YaRN and its placement against OLMo-core, the presets, a stage-2
run carried into stage 3, and the bad input it refuses."""

import dataclasses
import functools
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from commands import train_py
from hf_models import FULL, make_hf
from test_stages import SMALL, arrays, on_tiny, small_recipe, stage1_run, started  # noqa: F401 (a fixture)
from tolerance import attention_terms, chain, grad_terms, loss_terms, mean_terms, model_terms, sum_tol

import ckpt
import data
import olmo3
import shard
import train

ROOT = Path(__file__).resolve().parent.parent
YARN = {"factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}


def packed_rows(vocab: int, seq: int, eos: int, pad: int):
    """Two packed rows as data.PackedLoader gives them: (tokens, label mask, documents, each row's document
    lengths with the padding's last)."""
    rng = np.random.default_rng(0)
    lengths = [[11, 17, 5, 9, 6], [30, 14, 4]]  # each row's last entry is its padding
    tokens, documents = np.full((2, seq), pad), np.zeros((2, seq), np.int32)
    for r, row in enumerate(lengths):
        start = 0
        for d, n in enumerate(row):
            if d < len(row) - 1:
                tokens[r, start : start + n] = np.append(rng.integers(2, vocab, n - 1), eos)
            documents[r, start : start + n] = d
            start += n
    mask = np.ones((2, seq), bool)
    for r, row in enumerate(lengths):
        mask[r, seq - row[-1] :] = False
    return tokens, mask, documents, lengths


def transformers_loss_and_grads(hf, tokens, mask, lengths, positions: str, z_loss: float):
    """OLMo-core's loss (get_labels with the label mask, cross_entropy_loss with z-loss, over the batch's
    labels) of logits made by transformers running each document of a row alone, at its positions in the row
    or from 0: exactly what document masking computes. Returns the loss and {HF name: gradient}."""
    from olmo_core.data.utils import get_labels
    from olmo_core.nn.functional import cross_entropy_loss

    hf.zero_grad()
    rows = []
    for r, row in enumerate(lengths):
        parts, start = [], 0
        for n in row[:-1]:
            ids = torch.as_tensor(tokens[r, start : start + n])[None]
            where = torch.arange(start, start + n) if positions == "row" else torch.arange(n)
            parts.append(hf(input_ids=ids, position_ids=where[None]).logits[0])
            start += n
        parts.append(torch.zeros(row[-1], hf.config.vocab_size))  # the padding: never a label's position
        rows.append(torch.cat(parts))
    # OLMo-core's LM head spans the vocabulary padded to a multiple of 128 (as ours); these rows are zero.
    logits = torch.nn.functional.pad(torch.stack(rows), (0, -hf.config.vocab_size % 128))
    batch = {"input_ids": torch.as_tensor(tokens), "label_mask": torch.as_tensor(mask)}
    labels = get_labels(batch)
    n = (labels != -100).sum()
    ce, z = cross_entropy_loss(
        logits.view(-1, logits.shape[-1]),
        labels.view(-1),
        reduction="sum",
        compute_z_loss=True,
        z_loss_multiplier=z_loss,
    )
    loss = (ce + z) / n
    loss.backward()
    return loss.item(), {name: p.grad.numpy() for name, p in hf.named_parameters()}


@pytest.mark.parametrize(
    "positions, attention", [("row", "reference"), ("document", "reference"), ("row", "local")]
)
def test_packed_loss_and_gradients_are_transformers_on_each_document_alone(tmp_path, positions, attention):
    """A packed batch through train.loss_fn (documents masked, YaRN on the full layers, the padding out of the
    loss): the loss and every parameter's gradient equal transformers' on each document alone, weighed as
    OLMo-core's train module weighs the labels."""
    vocab, seq, eos, pad = 300, 48, 1, 0
    hf = make_hf(tmp_path, vocab=vocab, window=8, yarn=YARN)
    hf.train()  # no dropout in Olmo3; gradients on
    model = ckpt.load_hf(tmp_path).using(olmo3.Compute(attention=attention))
    assert model.cfg.rope_full.yarn is not None and model.cfg.rope_sliding.yarn is None
    tokens, mask, documents, lengths = packed_rows(vocab, seq, eos, pad)
    cfg = dataclasses.replace(train.PRESETS["tiny"], positions=positions, z_loss=1e-2, pack_files=1)
    keep = jnp.ones(2, bool)
    row_weight = train.row_weights(keep, jnp.asarray(mask[:, 1:].sum(-1)), seq, 1)
    loss = lambda m: train.loss_fn(
        m, jnp.asarray(tokens), keep, row_weight, cfg, None, jnp.asarray(mask), jnp.asarray(documents)
    )
    (ours, _), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    want, want_grads = transformers_loss_and_grads(hf, tokens, mask, lengths, positions, cfg.z_loss)
    # fp32 rounding: the model's sums, then the loss over the targets and each weight's gradient over the tokens
    targets = int(mask[:, 1:].sum())
    assert float(ours) == pytest.approx(want, rel=sum_tol(loss_terms(model.cfg, seq, targets)))
    # transformers' LM head has no padding rows (their logits, zero here, still take a share of the softmax)
    grads = eqx.tree_at(lambda g: g.lm_head, grads, grads.lm_head.at[:, vocab:].set(0))
    theirs = ckpt.assemble(
        eqx.filter(grads, eqx.is_array),
        ckpt.hf_names(model.cfg),
        lambda name, _, region: want_grads[name][region],
        model.cfg.vocab_size,
    )
    for path, a, b in zip(jax.tree.leaves_with_path(grads), arrays(grads), arrays(theirs), strict=True):
        scale = np.abs(b).max()
        tol = sum_tol(grad_terms(model.cfg, seq, tokens.size), scale)
        assert scale > 0 and np.abs(a - b).max() <= tol, jax.tree_util.keystr(path[0])


def test_yarn_is_olmo_core_s_and_on_its_full_layers_only():
    """The 7B stage-3 model (train.model_config of the preset): YaRN's frequencies and attention factor as
    OLMo-core's YaRNRoPEScalingConfig computes them, on the layers OLMo-core's with_rope_scaling gives it
    (those without a sliding window), the sliding layers' RoPE untouched."""
    from olmo_core.nn.rope import YaRNRoPEScalingConfig
    from olmo_core.nn.transformer import TransformerConfig

    m = train.model_config(train.PRESETS["7b-long-context"])
    assert m.max_seq_len == 65_536 and m.rope_sliding == olmo3.MODELS["7b"].rope_sliding
    scaling = YaRNRoPEScalingConfig(factor=8, beta_fast=32, beta_slow=1, old_context_len=8192)
    want, want_scale = scaling.compute_scaled_inv_freq(500_000, 128, torch.device("cpu"))
    ours, scale = olmo3.rope_frequencies(m.rope_full, m.head_dim)
    # Elementwise, no sums: NumPy's fp32 power (SVML on AVX-512 CPUs, up to 4 ulp) against torch's (1 ulp),
    # then a reciprocal and YaRN's blend, four operations, each half an ulp on each side.
    np.testing.assert_allclose(ours, want.numpy(), rtol=sum_tol(4 + 1 + 5))
    assert scale == pytest.approx(want_scale, rel=1e-12)
    reference = TransformerConfig.olmo3_7B(vocab_size=100_352).with_rope_scaling(scaling)
    scaled = sorted(i for i, b in (reference.block_overrides or {}).items() if b.sequence_mixer.rope.scaling)
    assert scaled == [i for i, t in enumerate(m.layer_types) if t == FULL]


def test_stage3_presets_are_the_scripts():
    """What OLMo-core's OLMo-3-1025-7B-long-context.py and the 32B's set, and the horizon the 7B's released
    stage 3 implies (the script's max_duration is stage 1's)."""
    seven, big = train.PRESETS["7b-long-context"], train.PRESETS["32b-long-context"]
    assert (seven.seq_len, seven.global_batch, seven.seq_len * seven.global_batch) == (65_536, 64, 4_194_304)
    assert (seven.pack_files, seven.file_seed, seven.seed, seven.positions) == (8, 123, 34521, "row")
    assert (seven.schedule, seven.warmup_steps, seven.lr_final, seven.yarn) == ("linear", 200, 0.0, 8.0)
    assert seven.lr_horizon == seven.steps == -(-50_000_000_000 // 4_194_304)
    assert train.lr_at(200, seven) == seven.lr and train.lr_at(seven.steps, seven) == 0.0
    assert (big.model, big.global_batch, big.repeat_filter) == ("32b", 128, 32)
    assert big.lr_horizon == -(-100_000_000_000 // (128 * 65_536))


def test_a_stage2_run_goes_on_into_stage3_with_yarn_and_the_longer_context(
    small_recipe,  # noqa: F811
    tiny_data,
    tmp_path,
    monkeypatch,
):
    """`train.py --preset 7b-long-context --init_from STAGE2_RUN`: the stage-3 run starts from the same weights
    and Adam state, now a model with YaRN on its full layers and the stage's context."""
    stage1, _ = small_recipe
    stage3 = dataclasses.replace(train.PRESETS["7b-long-context"], model="small", seq_len=1024, skip_window=8)
    model, opt = stage1_run(tmp_path / "stage2", stage1, seed=0)
    cfg = on_tiny(stage3, tiny_data, tmp_path / "stage3", init_from=str(tmp_path / "stage2"))
    step, got, new, _ = started(cfg, monkeypatch)
    assert step == 0 and got.cfg == train.model_config(stage3) and got.cfg.rope_full.yarn.factor == 8.0
    assert got.cfg.rope_full.yarn.original_max_position == SMALL.max_seq_len
    for want, have in [(model, got), (opt.mu, new.mu)]:
        for a, b in zip(arrays(want), arrays(have), strict=True):
            np.testing.assert_array_equal(a, b)


# ---- cuDNN's packed layout (GPUs): the segments it is given, against the document mask


def mask_of_segments(offsets: np.ndarray, lengths: np.ndarray, seq: int, window: int | None) -> np.ndarray:
    """The (query, key) pairs cuDNN's packed layout attends, as JAX documents it: each segment (a start and a
    length; -1 an unused slot) alone, causal and (sliding layers) keys (s - window, s] from its own start."""
    mask = np.zeros((seq, seq), bool)
    for start, n in zip(offsets[:-1], lengths):
        if n >= 0:
            s, t = np.arange(n)[:, None], np.arange(n)[None, :]
            mask[start : start + n, start : start + n] = (t <= s) & (s - t < (window or seq))
    return mask


@pytest.mark.parametrize("window", [None, 8])
def test_cudnn_s_segments_are_the_document_mask(window):
    """olmo3.document_segments turns packed rows' documents into cuDNN's segments: what they attend is the
    reference's document mask (olmo3.causal_mask and the same document), every position in one segment, the
    unused slots -1. A row may hold fewer documents than the bound, or exactly as many."""
    seq, most = 48, 6  # packed_rows' rows
    documents = packed_rows(vocab=50, seq=seq, eos=1, pad=0)[2]
    rng = np.random.default_rng(0)
    cuts = [np.sort(rng.choice(np.arange(1, seq), n - 1, replace=False)) for n in (most, 1, 3)]
    documents = np.concatenate(
        [documents, [np.repeat(np.arange(len(c) + 1), np.diff(c, prepend=0, append=seq)) for c in cuts]]
    )
    offsets, lengths = map(
        np.asarray, jax.jit(olmo3.document_segments, static_argnums=1)(jnp.asarray(documents), most)
    )
    assert offsets.shape == (len(documents), most + 1) and lengths.shape == (len(documents), most)
    for row, starts, n in zip(documents, offsets, lengths):
        want = np.asarray(olmo3.causal_mask(seq, window)) & (row[:, None] == row[None, :])
        np.testing.assert_array_equal(mask_of_segments(starts, n, seq, window), want)
        used = len(np.unique(row))
        assert n[:used].sum() == seq and (n[used:] == -1).all() and (starts[used:] == -1).all()


def test_cudnn_s_bound_on_documents_is_counted_in_the_data_and_refused_below_it(tmp_path):
    """train.documents_bound: --max_documents 0 compiles cuDNN's packed layout for the data's most documents
    a row (the padding one of them, as the loader numbers them); a bound below it is one line, before compiling."""
    from test_data import packed_files

    loader = data.PackedLoader(
        packed_files(tmp_path, eos=1), 64, 4, eos_id=1, pad_id=0, group_size=2, seed=1, dtype=np.uint16
    )
    most = max(int(loader.global_batch(i)[2].max(initial=0)) + 1 for i in range(loader.num_batches))
    cfg = dataclasses.replace(train.PRESETS["tiny"], seq_len=64, pack_files=2)
    cudnn = olmo3.Compute("bfloat16", "cudnn")
    assert (
        train.documents_bound(cfg, cudnn, loader).max_documents == loader.packed.most_documents() >= most > 2
    )
    assert (
        train.documents_bound(cfg, dataclasses.replace(cudnn, max_documents=99), loader).max_documents == 99
    )
    low = dataclasses.replace(cudnn, max_documents=2)
    with pytest.raises(
        train.FlagError,
        match=f"^--max_documents 2: the packed data has a row of {loader.packed.most_documents()} documents",
    ):
        train.documents_bound(cfg, low, loader)
    assert train.documents_bound(
        cfg, dataclasses.replace(low, attention="local"), loader
    ) == dataclasses.replace(low, attention="local")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--positions", "document"], "--positions document: goes with --pack_files N"),
        (["--file_seed", "123"], "--file_seed 123: goes with --pack_files N"),
        (["--yarn", "0.5"], "--yarn 0.5: expected a factor above 1"),
        (["--max_documents", "4"], "--max_documents 4: goes with --pack_files N"),
        (
            ["--pack_files", "8", "--attention", "cudnn", "--dtype", "bfloat16", "--dry_run"],
            "--max_documents 0: cuDNN's packed attention compiles for a most documents a row",
        ),
        (["--mesh", "context=3"], "--mesh context=3 (context=3): --seq_len 256 does not split into 6 equal"),
        (
            ["--mesh", "context=8"],
            "--mesh context=8 (context=8): each device's chunks of 16 positions are not",
        ),
        (
            ["--mesh", "context=2", "--attention", "cudnn", "--dtype", "bfloat16"],
            "--mesh context=2 (context=2): attention 'cudnn' does",
        ),
        (  # before, Splash's backward failed as it compiled (block_q must be a multiple of 128)
            ["--mesh", "context=2", "--attention", "splash"],
            "--seq_len 256 over --mesh context=2: chunks of 64, 128 keys with the window: attention 'splash' "
            "takes blocks of a multiple of 128 positions",
        ),
        (["--seq_len", "64", "--attention", "splash"], "--seq_len 64: attention 'splash' takes blocks of a"),
    ],
)
def test_bad_stage3_flags_are_one_line(tmp_path, flags, message):
    proc = train_py(["--preset", "tiny", "--run_dir", tmp_path / "run", *flags])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert not (tmp_path / "run").exists()


# ---- the context axis: every layout equal to one device

# A model whose sliding window (32) makes whole blocks of the chunks context=2 and context=4 cut 256 into.
CONTEXT_MODEL = dataclasses.replace(
    olmo3.MODELS["tiny"],
    vocab_size=512,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    mlp_hidden=128,
    sliding_window=32,
    rope_full=olmo3.Rope(yarn=olmo3.Yarn(factor=8.0, original_max_position=64)),
)
CONTEXT_RECIPE = dataclasses.replace(train.PRESETS["tiny"], seq_len=256, pack_files=2, z_loss=1e-3)


@pytest.fixture(scope="module")
def context_runs(tmp_path_factory):
    """run(spec, attention): two train steps of CONTEXT_MODEL on packed batches (data.PackedLoader over
    documents of 1 to 200 tokens), from the same initial parameters: the metrics and the parameters after."""
    folder, rng = tmp_path_factory.mktemp("packed"), np.random.default_rng(5)
    paths = []
    for k in range(4):
        docs = [np.append(rng.integers(2, 512, n - 1), 1) for n in rng.integers(1, 200, 40)]
        paths.append(str(folder / f"{k}.npy"))
        np.concatenate(docs).astype(np.uint16).tofile(paths[-1])
    cfg = CONTEXT_RECIPE
    loader = data.PackedLoader(
        paths, cfg.seq_len, cfg.global_batch, eos_id=1, pad_id=0, group_size=2, seed=cfg.seed, dtype=np.uint16
    )
    batches = [loader.global_batch(i) for i in range(2)]
    assert all(len(np.unique(docs[0])) > 2 for _, _, docs in batches)  # rows of several documents

    @functools.cache  # the single-device run, once per kernel and dtype
    def run(spec: str, attention: str, dtype: str = "float32"):
        compute = olmo3.Compute(dtype, attention=attention)
        model = olmo3.Olmo3(CONTEXT_MODEL, key=jax.random.key(0), compute=compute)
        opt = train.init_opt(eqx.filter(model, eqx.is_array), cfg)
        mesh = None if spec == "single" else shard.make_mesh(spec)
        if mesh is not None:
            model = eqx.filter_shard(model, shard.shardings(model, mesh))
            opt = eqx.filter_shard(opt, shard.shardings(opt, mesh))
        put = (
            (lambda a: jnp.asarray(a.astype(np.int32) if a.dtype != bool else a))
            if mesh is None
            else (lambda a: shard.put_batch(a, mesh, len(a)))
        )
        metrics = []
        for k, (tokens, mask, documents) in enumerate(batches, start=1):
            lr = jnp.float32(train.lr_at(k, cfg))
            kw = dict(cfg=cfg, n_micro=1, mesh=mesh, label_mask=put(mask), documents=put(documents))
            model, opt, m = train.train_step(model, opt, put(tokens), lr, **kw)
            metrics.append({name: float(m[name]) for name in ("loss", "grad_norm")})
        return metrics, [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, attention",
    [("context=4", "local"), ("fsdp=2,context=2,tensor=2", "local"), ("data=2,context=4", "reference")],
)
def test_context_split_steps_equal_the_single_device_run(context_runs, spec, attention):
    """Packed rows (documents masked, YaRN on the full layers) split over a context axis in the balanced
    order, alone and with the other axes: the losses, grad norms and parameters after two steps equal one
    device's to fp32 rounding."""
    want, want_params = context_runs("single", attention)
    got, got_params = context_runs(spec, attention)
    # fp32 rounding of the model's sums in other orders, over a batch of global_batch x seq_len tokens
    cfg, seq = CONTEXT_RECIPE, CONTEXT_RECIPE.seq_len
    grad = sum_tol(grad_terms(CONTEXT_MODEL, seq, cfg.global_batch * seq))
    rel = {"loss": sum_tol(loss_terms(CONTEXT_MODEL, seq, cfg.global_batch * seq)), "grad_norm": grad}
    for a, b in zip(got, want, strict=True):
        for name in ("loss", "grad_norm"):
            assert abs(a[name] - b[name]) <= rel[name] * abs(b[name]), (name, a[name], b[name])
    # A parameter after the steps: each rounds its sum with the update (an ulp of it) and the update, lr times
    # Adam's ratio (about 1 an entry), off by the gradient's rounding.
    lrs = sum(train.lr_at(k, cfg) for k in (1, 2))
    for a, b in zip(got_params, want_params, strict=True):
        assert np.linalg.norm(a - b) <= 2 * sum_tol(1, np.linalg.norm(b)) + grad * lrs * np.sqrt(b.size)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["data=2,context=2,tensor=2"])  # fsdp: test_shard's bf16 gradients
def test_bf16_steps_on_each_device_s_own_weight_copies_follow_the_single_device_run(context_runs, spec):
    """bf16 layers, gradients summed in fp32 (--reduce_dtype float32: each device that holds other tokens runs
    the layers with its own copy of the weights, shard.Layout.weights) over the data, fsdp, context and tensor
    axes: the same step as one device's, to bf16 rounding. Each device's bf16 gradient rounds differently from
    the whole batch's (its own sums of bf16 products), so the two agree to bf16's precision, not fp32's: the
    loss and the grad norm to one bf16 ulp (2^-8; measured: under 0.002 and 0.15 of it), the parameters to
    an ulp and each step's update (lr times Adam's ratio, about 1 an entry) off by 10% where gradients near
    zero flip sign (measured: under 0.2 of that). A copy summed twice, or a device's tokens given to another's
    copy, is off by 100%."""
    want, want_params = context_runs("single", "local", "bfloat16")
    got, got_params = context_runs(spec, "local", "bfloat16")
    for a, b in zip(got, want, strict=True):
        for name in ("loss", "grad_norm"):
            assert abs(a[name] - b[name]) <= 2**-8 * abs(b[name]), (name, a, b)
    lrs = sum(train.lr_at(k, CONTEXT_RECIPE) for k in (1, 2))
    for a, b in zip(got_params, want_params, strict=True):
        assert np.linalg.norm(a - b) <= 2**-8 * np.linalg.norm(b) + 0.1 * lrs * np.sqrt(b.size)


def test_balanced_order_gives_each_device_the_same_causal_work():
    """olmo3.balanced_order: a permutation whose n runs each hold one early and one late chunk, so every
    device computes the same number of (query, key) pairs under the causal mask (a plain split: 2n - 1 times
    as many on the last device as on the first)."""
    seq, n = 1024, 4
    order = olmo3.balanced_order(seq, n)
    assert sorted(order.tolist()) == list(range(seq))
    pairs = (order + 1).reshape(n, -1).sum(axis=1)  # a query at position p sees p + 1 keys
    assert len(set(pairs.tolist())) == 1
    plain = (np.arange(seq) + 1).reshape(n, -1).sum(axis=1)
    assert plain[-1] / plain[0] > 2 * n - 2


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["fsdp=2,context=2,tensor=2"])
def test_splash_over_a_context_axis_equals_the_reference(spec):
    """Splash with the row split over a context axis (each device's two chunks: a sliding layer's against the
    window before and itself, a full layer's against the whole row under the chunk's causal offset), packed
    documents as segment ids: forward and gradients equal the reference attention on the whole row.
    (Interpreted here, as the mesh's CPU devices need; test_splash_over_a_context_axis_compiles_for_a_tpu
    compiles it.)"""
    mesh, seq = shard.make_mesh(spec), 1024
    layout, n = shard.Layout(mesh), mesh.shape["context"]
    order = olmo3.balanced_order(seq, n)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, seq, heads, 16)), jnp.float32) for heads in (4, 2, 2))
    documents = jnp.asarray(np.sort(rng.integers(0, 4, (2, seq)), axis=1), jnp.int32)
    for window in (128, None):
        loss = lambda impl, ly, ctx: (
            lambda q, k, v, d: (olmo3.attention(q, k, v, window, impl, ly, d, context=ctx) ** 2).sum()
        )
        want, want_grads = jax.value_and_grad(loss("reference", None, 1), argnums=(0, 1, 2))(
            q, k, v, documents
        )
        split = lambda x: x[:, order]  # the row as the context axis holds it
        sharded = jax.jit(jax.value_and_grad(loss("splash", layout, n), argnums=(0, 1, 2)))
        got, got_grads = sharded(split(q), split(k), split(v), split(documents))
        # fp32 rounding: each output's attention over the keys it may see (squared: twice), the sum over the
        # outputs; the gradients, back through the same sums
        keys = window or seq
        np.testing.assert_allclose(got, want, rtol=sum_tol(mean_terms(2 * attention_terms(16, keys), q.size)))
        tol = sum_tol(chain(attention_terms(16, keys), attention_terms(16, keys)))
        for a, b in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(a, split(b), rtol=0, atol=tol * np.abs(b).max())


def test_splash_over_a_context_axis_compiles_for_a_tpu():
    """The context-split Splash for a v5e:2x2 (context=2, tensor=2), forward and backward: every attention
    call a Mosaic kernel, segmented (documents), the full layer's causal chunks one kernel per chunk offset."""
    import re

    target = shard.compile_target("v5e:2x2")
    mesh = shard.make_mesh("context=2,tensor=2", list(target.devices))
    layout = shard.Layout(mesh)
    at = lambda *axes: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))
    q = jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16, sharding=at(None, "context", "tensor"))
    kv = jax.ShapeDtypeStruct((2, 4096, 2, 128), jnp.bfloat16, sharding=at(None, "context", "tensor"))
    documents = jax.ShapeDtypeStruct((2, 4096), jnp.int32, sharding=at(None, "context"))
    kernels = {}
    for window in (1024, None):
        loss = lambda q, k, v, d: olmo3.attention(q, k, v, window, "splash", layout, d, context=2).sum()
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, documents).compile().as_text()
        calls = re.findall(r'custom_call_target="tpu_custom_call".*?op_name="([^"]*)"', hlo, re.DOTALL)
        kernels[window] = sorted(re.search(r"(splash_mha_[a-z_]+?)/pallas_call", c).group(1) for c in calls)
    assert (
        kernels[1024]
        == ["splash_mha_dkv_segmented_no_residuals"] * 2 + ["splash_mha_fwd_segmented_residuals"] * 2
    )
    assert (
        kernels[None]
        == ["splash_mha_dkv_segmented_no_residuals"] * 4 + ["splash_mha_fwd_segmented_residuals"] * 4
    )


def test_a_stage3_export_reads_in_transformers_as_it_trained(tmp_path):
    """A stage-3 model exported to Hugging Face: transformers' Olmo3ForCausalLM reads its config (YaRN on the
    full layers only, the stage's context) and computes our logits at 1,024 positions, 16 times the model's
    original context; a config in the style of AI2's releases (one rope_theta, a rope_scaling) reads the same,
    as transformers 5 puts rope_scaling on the full layers only. With YaRN on every layer (what a reader
    that applies rope_scaling globally computes) the logits would be another model's."""
    import json

    from hf_models import hf_logits
    from transformers import Olmo3ForCausalLM

    cfg = dataclasses.replace(CONTEXT_MODEL, max_seq_len=1024)
    model = olmo3.Olmo3(cfg, key=jax.random.key(1))
    sharp = lambda w: w * 6  # sharper attention, so that RoPE's frequencies show in the logits
    model = eqx.tree_at(
        lambda m: (m.layers.self_attn.q_proj, m.layers.self_attn.k_proj), model, replace_fn=sharp
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 1024))
    ours = np.asarray(model(jnp.asarray(tokens)))[..., : cfg.vocab_size]
    ckpt.save_hf(model, tmp_path / "hf")
    config_file = tmp_path / "hf" / "config.json"
    exported = json.loads(config_file.read_text())
    assert exported["rope_parameters"]["sliding_attention"]["rope_type"] == "default"
    assert exported["rope_parameters"]["full_attention"]["rope_type"] == "yarn"

    def theirs(config: dict) -> np.ndarray:
        config_file.write_text(json.dumps(config))
        return hf_logits(
            Olmo3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager"), tokens
        )

    scale = np.abs(ours).max()
    tol = sum_tol(model_terms(cfg, 1024), scale)  # fp32 rounding of the model's sums, in torch's orders
    assert np.abs(theirs(exported) - ours).max() <= tol
    released = {k: v for k, v in exported.items() if k != "rope_parameters"}
    released |= dict(rope_theta=500_000.0, rope_scaling=exported["rope_parameters"]["full_attention"])
    assert np.abs(theirs(released) - ours).max() <= tol
    everywhere = exported["rope_parameters"]["full_attention"]
    every_layer = exported | {
        "rope_parameters": {"sliding_attention": everywhere, "full_attention": everywhere}
    }
    assert np.abs(theirs(every_layer) - ours).max() > 1e-2 * scale


@pytest.mark.slow
def test_a_packed_run_over_a_context_axis_killed_mid_step_resumes_bitwise(tmp_path):
    """Stage 3 end to end through train.py (packed documents, shuffled files, YaRN, positions restarting at
    each document, rows split over a context axis): killed mid-step and restarted, it logs every step once,
    bit for bit as the uninterrupted run, whose data position is a function of the step alone."""
    import json
    import signal

    rng = np.random.default_rng(0)
    for k in range(4):
        docs = [np.append(rng.integers(1, 8192, n - 1), 0) for n in rng.integers(1, 300, 60)]
        np.concatenate(docs).astype(np.uint16).tofile(tmp_path / f"{k}.npy")
    flags = "--preset tiny --seq_len 256 --global_batch 4 --steps 8 --lr_horizon 8 --warmup_steps 2"
    flags += " --ckpt_every 3 --eval_every 1000 --samples 0 --pack_files 2 --file_seed 123 --yarn 8"
    flags += " --positions document --mesh context=2"
    argv = [*flags.split(), "--data", tmp_path / "*.npy"]
    run = lambda run_dir, fault="none:0": train_py([*argv, "--run_dir", run_dir], fault)

    def rows(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if '"loss"' in line]

    assert run(tmp_path / "whole").returncode == 0
    assert run(tmp_path / "killed", "mid_step:5").returncode == -signal.SIGKILL
    resumed = run(tmp_path / "killed")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout and "(step 3)" in resumed.stdout
    want, got = rows(tmp_path / "whole"), rows(tmp_path / "killed")
    assert [r["step"] for r in got] == list(range(1, 9))
    for a, b in zip(got, want, strict=True):
        assert all(a[key] == b[key] for key in ("loss", "grad_norm", "batch_hash", "lr")), (a, b)
