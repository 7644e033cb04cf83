"""The model against independent references: transformers' Olmo3ForCausalLM (PyTorch, eager attention),
brute-force NumPy attention, and OLMo-core's model configs."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
import torch
from hf_models import FULL, SLIDING, hf_logits, make_hf, markov_tokens, train_briefly
from tolerance import attention_terms, chain, grad_terms, model_terms, sum_tol

import ckpt
import olmo3

SEQ = 40
YARN = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
CONFIGS = {
    "mha": dict(),
    "gqa": dict(heads=8, kv_heads=2, d=64),
    "vocab_not_128_multiple": dict(vocab=1000),
    "all_full": dict(types=[FULL] * 4),
    "sliding_full_pairs": dict(types=[SLIDING, FULL] * 2, window=5),
    "yarn_on_full_layers": dict(yarn=YARN),
}


def tokens(n=SEQ, vocab=300, seed=0, batch=2):
    return np.random.default_rng(seed).integers(0, vocab, (batch, n))


def rel_err(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers_fp32(tmp_path, name):
    kw = CONFIGS[name]
    hf = make_hf(tmp_path, **kw)
    model = ckpt.load_hf(tmp_path)
    ids = tokens(vocab=kw.get("vocab", 300))
    ours = np.asarray(model(jnp.asarray(ids)))  # the batch at once, as training runs it
    tol = sum_tol(model_terms(model.cfg, SEQ))  # the model's sums rounded in other orders, relative
    by_row = np.asarray(jax.vmap(model)(jnp.asarray(ids)))
    np.testing.assert_allclose(by_row, ours, rtol=0, atol=tol * np.abs(ours).max())
    theirs = hf_logits(hf, ids)
    vocab = model.cfg.vocab_size
    assert ours.shape == (2, SEQ, model.cfg.padded_vocab) and model.cfg.padded_vocab % 128 == 0
    assert rel_err(ours[..., :vocab], theirs) <= tol
    assert (ours[..., :vocab].argmax(-1) == theirs.argmax(-1)).all()
    np.testing.assert_array_equal(ours[..., vocab:], 0.0)  # padded rows load as zeros


def test_window_shorter_than_sequence_matters(tmp_path):
    # Guard against a test that passes because the window never bites: with window 8 < 40, making the
    # sliding layers full changes the reference's logits.
    hf = make_hf(tmp_path)
    ids = tokens()
    as_full = make_hf(tmp_path / "full", types=[FULL] * 4)
    as_full.load_state_dict(hf.state_dict())
    assert rel_err(hf_logits(as_full, ids), hf_logits(hf, ids)) > 1e-3


def test_bf16_compute_top1_agreement(tmp_path):
    # A random model's logits are nearly flat, so top-1 is a coin toss under any rounding; a briefly trained
    # one is confident, as a released checkpoint is.
    hf = train_briefly(make_hf(tmp_path, heads=8, kv_heads=2, vocab=1000, save=False), steps=100)
    hf.save_pretrained(tmp_path)
    model = ckpt.load_hf(tmp_path, compute=olmo3.Compute(dtype="bfloat16"))
    ids = markov_tokens(1000, 64, 8, seed=10_000)
    ours = np.asarray(jax.vmap(model)(jnp.asarray(ids)))[..., :1000]
    agreement = (ours.argmax(-1) == hf_logits(hf, ids).argmax(-1)).mean()
    print(f"bf16 top-1 agreement with fp32 transformers: {agreement:.4f}")
    assert agreement >= 0.99


def brute_force_attention(q, k, v, window, documents=None):
    """Softmax attention with an explicit mask, one head at a time, in float64 NumPy; with `documents`, a
    query sees only the keys of its own document."""
    seq, heads, hd = q.shape
    group = heads // k.shape[1]
    same = lambda s, t: documents is None or documents[s] == documents[t]
    out = np.zeros(q.shape)
    for h in range(heads):
        for s in range(seq):
            keys = [t for t in range(seq) if t <= s and (window is None or s - t < window) and same(s, t)]
            scores = np.array([q[s, h] @ k[t, h // group] for t in keys]) / np.sqrt(hd)
            p = np.exp(scores - scores.max())
            p /= p.sum()
            out[s, h] = sum(pi * v[t, h // group] for pi, t in zip(p, keys))
    return out


# Against float64: fp32's rounding of an attention output over (at most) 12 keys of head_dim 8, relative.
BRUTE_TOL = sum_tol(attention_terms(8, 12))


@pytest.mark.parametrize("impl", ["reference", "local"])
@pytest.mark.parametrize("window", [None, 1, 4, 5])
def test_attention_equals_brute_force(window, impl):
    # "local" runs in blocks of `window` queries where the window divides the sequence (4 here: three
    # blocks, the first without a previous one), and is the reference otherwise.
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((12, n, 8)).astype(np.float32) for n in (4, 2, 2))
    ours = olmo3.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window, impl)
    want = brute_force_attention(q, k, v, window)
    np.testing.assert_allclose(np.asarray(ours), want, rtol=0, atol=BRUTE_TOL * np.abs(want).max())


# Packed documents of 3, 5, 1 and 3 tokens: boundaries inside and across the local kernel's 4-query blocks.
DOCUMENTS = np.array([0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3])


@pytest.mark.parametrize("impl", ["reference", "local"])
@pytest.mark.parametrize("window", [None, 4, 5])
def test_document_masked_attention_equals_brute_force(window, impl):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 12, n, 8)).astype(np.float32) for n in (4, 2, 2))
    documents = np.stack([DOCUMENTS, np.zeros(12, int)])  # a packed row, and one document (no masking)
    ours = olmo3.attention(*map(jnp.asarray, (q, k, v)), window, impl, documents=jnp.asarray(documents))
    for row in range(2):
        want = brute_force_attention(q[row], k[row], v[row], window, documents[row])
        np.testing.assert_allclose(np.asarray(ours[row]), want, rtol=0, atol=BRUTE_TOL * np.abs(want).max())
    # A document's outputs are its own: the same as attention over that document alone.
    alone = olmo3.attention(*(jnp.asarray(x[0, 3:8]) for x in (q, k, v)), window, impl)
    # Two fp32 orders of the same sums: the same bound.
    np.testing.assert_allclose(ours[0, 3:8], alone, rtol=0, atol=BRUTE_TOL * np.abs(alone).max())


@pytest.mark.parametrize("impl", ["reference", "local"])
def test_a_packed_row_s_documents_are_each_computed_as_alone(impl):
    """The model on a row of packed documents, masked by document: each document's hidden states are the
    model's on that document alone (RoPE sees only relative positions, so its offset in the row is not seen)."""
    cfg = dataclasses.replace(olmo3.MODELS["tiny"], sliding_window=4)
    model = olmo3.Olmo3(cfg, key=jax.random.key(0), compute=olmo3.Compute(attention=impl))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 16)))
    documents = jnp.asarray([[0] * 3 + [1] * 6 + [2] * 7])
    packed = model.features(tokens, documents=documents)
    tol = sum_tol(model_terms(cfg, 16), np.abs(packed).max())  # the model's sums in other orders
    for start, end in [(0, 3), (3, 9), (9, 16)]:
        alone = model.features(tokens[:, start:end])
        np.testing.assert_allclose(packed[:, start:end], alone, rtol=0, atol=tol)
    unmasked = model.features(tokens)[:, 3:9]
    assert not np.allclose(unmasked, packed[:, 3:9], atol=100 * tol)  # masking did far more than rounding
    # Positions restarted at each document (OLMo-core since May 2026): each document as alone, to fp32 rounding.
    positions = olmo3.document_positions(documents)
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6]])
    restarted = model.features(tokens, documents=documents, positions=positions)
    for start, end in [(0, 3), (3, 9), (9, 16)]:
        np.testing.assert_allclose(
            restarted[:, start:end], model.features(tokens[:, start:end]), rtol=0, atol=tol
        )


def test_local_attention_gradients_equal_the_reference():
    rng = np.random.default_rng(2)
    q, k, v, g = (jnp.asarray(rng.standard_normal((2, 32, n, 8)), jnp.float32) for n in (4, 2, 2, 4))
    grads = {
        impl: jax.vjp(lambda *a: olmo3.attention(*a, 8, impl), q, k, v)[1](g)
        for impl in ("reference", "local")
    }
    tol = sum_tol(chain(attention_terms(8, 8), attention_terms(8, 8)))  # forward and backward, window 8
    for ref, local in zip(grads["reference"], grads["local"]):
        np.testing.assert_allclose(local, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_long_rows_full_layers_a_block_of_queries_at_a_time_equal_brute_force(monkeypatch):
    """The "local" path takes a long row's full layers QUERY_BLOCK queries at a time (what lets a CPU read a
    65,536-token row): brute force forward, with and without documents, and a sliding window that is not
    whole blocks kept; the reference's gradients."""
    monkeypatch.setattr(olmo3, "QUERY_BLOCK", 4)  # 12 positions: 3 blocks, documents across their edges
    rng = np.random.default_rng(6)
    q, k, v, g = (jnp.asarray(rng.standard_normal((2, 12, n, 8)), jnp.float32) for n in (4, 2, 2, 4))
    documents = np.stack([DOCUMENTS, np.zeros(12, int)])
    for window, docs in [(None, None), (None, documents), (5, documents)]:
        ours = olmo3.attention(
            q, k, v, window, "local", documents=None if docs is None else jnp.asarray(docs)
        )
        for row in range(2):
            want = brute_force_attention(
                *(np.asarray(x[row]) for x in (q, k, v)), window, None if docs is None else docs[row]
            )
            np.testing.assert_allclose(
                np.asarray(ours[row]), want, rtol=0, atol=BRUTE_TOL * np.abs(want).max()
            )
    attend = lambda impl: lambda *a: olmo3.attention(*a, None, impl, documents=jnp.asarray(documents))
    want, got = (jax.vjp(attend(impl), q, k, v)[1](g) for impl in ("reference", "local"))
    tol = sum_tol(chain(attention_terms(8, 12), attention_terms(8, 12)))  # forward and backward
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def test_splash_kernel_equals_reference():
    # Splash is the TPU path; off TPU it runs in Pallas' interpreter, which checks the mask and scaling.
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((256, n, 64)), jnp.float32) for n in (4, 2, 2))
    # Two fp32 orders of an attention output over the keys a query sees (its window, or all 256), head_dim 64.
    close = lambda got, want, keys: np.testing.assert_allclose(
        got, want, rtol=0, atol=sum_tol(attention_terms(64, keys), np.abs(want).max())
    )
    for window in (None, 64):
        close(olmo3.attention(q, k, v, window, "splash"), olmo3.attention(q, k, v, window), window or 256)
    batch = [jnp.stack([x, x[::-1]]) for x in (q, k, v)]  # a batch runs the kernel once per sequence
    close(olmo3.attention(*batch, 64, "splash"), olmo3.attention(*batch, 64), 64)
    documents = jnp.asarray(np.repeat([[0, 1, 2, 3], [0, 0, 1, 1]], [60, 100, 90, 6], axis=1))  # packed rows
    close(
        olmo3.attention(*batch, 64, "splash", documents=documents),
        olmo3.attention(*batch, 64, documents=documents),
        64,
    )


def test_cudnn_refuses_fp32():
    x = jnp.zeros((8, 2, 16), jnp.float32)
    with pytest.raises(
        ValueError, match="^Compute.attention 'cudnn' needs bf16 or fp16 compute, got float32"
    ):
        olmo3.attention(x, x, x, 4, "cudnn")


def test_causality_and_window():
    cfg = dataclasses.replace(olmo3.MODELS["tiny"], layer_types=(SLIDING,) * 4, sliding_window=6)
    model = olmo3.Olmo3(cfg, key=jax.random.key(0))
    ids = jnp.asarray(tokens(n=48, batch=1, vocab=8192)[0])
    base = np.asarray(model(ids))
    for i in (0, 10, 30):
        changed = np.asarray(model(ids.at[i].set((ids[i] + 1) % 8192)))
        assert (changed[:i] == base[:i]).all()  # nothing before i moves
        assert not np.allclose(changed[i], base[i])
    # Each sliding layer reaches W-1 tokens back, so L layers reach L(W-1): past that, token 0 is invisible.
    reach = cfg.n_layers * (cfg.sliding_window - 1)
    changed = np.asarray(model(ids.at[0].set((ids[0] + 1) % 8192)))
    assert (changed[reach + 1 :] == base[reach + 1 :]).all()
    assert not np.allclose(changed[reach], base[reach])


def test_scan_equals_unrolled_loop(tmp_path):
    make_hf(tmp_path, layers=8)
    model = ckpt.load_hf(tmp_path)
    cfg = model.cfg
    ids = jnp.asarray(tokens(batch=1)[0])
    x = model.embed_tokens[ids]
    for i, t in enumerate(cfg.layer_types):
        block = jax.tree.map(lambda w: w[i], model.layers)
        x = block(x, *olmo3.rope_cos_sin(cfg.rope(t), cfg.head_dim, SEQ), cfg.window(t), cfg)
    looped = olmo3.linear(olmo3.rms_norm(x, model.norm, cfg.norm_eps), model.lm_head)
    # fp32 rounding only (XLA fuses the scan body and the loop differently); a wrong layer is ~1e-2 off
    tol = sum_tol(model_terms(cfg, SEQ), np.abs(looped).max())
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(looped), rtol=0, atol=tol)


@pytest.mark.parametrize("remat", ["full", "save_matmuls", "save_attention"])
def test_remat_policies_leave_gradients_unchanged(remat):
    cfg = olmo3.MODELS["tiny"]
    model = olmo3.Olmo3(cfg, key=jax.random.key(0))
    ids = jnp.asarray(tokens(n=32, batch=1, vocab=8192)[0])
    grad = lambda m: eqx.filter_grad(lambda m: m(ids).sum())(m).layers.mlp.up_proj
    with_remat = model.using(olmo3.Compute(remat=remat))
    # Recomputing may fuse the sums otherwise: a gradient's fp32 rounding (32 tokens), relative.
    tol = sum_tol(grad_terms(cfg, 32, 32))
    assert rel_err(np.asarray(grad(with_remat)), np.asarray(grad(model))) <= tol  # recompute may refuse ops


def test_wrong_input_shape_is_a_type_error():
    # pytest runs olmo3 under jaxtyping's import hook (pyproject's --jaxtyping-packages): a call whose arrays
    # disagree on a named dimension is refused before any maths, naming the argument and the dimension.
    cfg = olmo3.MODELS["tiny"]
    model = olmo3.Olmo3(cfg, key=jax.random.key(0))
    block = jax.tree.map(lambda w: w[0], model.layers)
    cos, sin = olmo3.rope_cos_sin(cfg.rope(olmo3.SLIDING), cfg.head_dim, 16)
    assert block(jnp.zeros((2, 16, cfg.d_model)), cos, sin, None, cfg).shape == (2, 16, cfg.d_model)
    with pytest.raises(jaxtyping.TypeCheckError, match=r"(?s)parameter 'cos'.*seq head_dim.*\bseq=8\b"):
        block(jnp.zeros((2, 8, cfg.d_model)), cos, sin, None, cfg)  # x fixes seq=8; RoPE's angles are for 16
    with pytest.raises(jaxtyping.TypeCheckError, match=r"(?s)parameter 'tokens'.*Expected type: .*Int\["):
        model(jnp.zeros(8, jnp.float32))  # token ids must be integers


def test_compute_refuses_unknown_values_naming_the_field():
    with pytest.raises(
        ValueError, match="^Compute.attention 'flash': expected one of auto, reference, local, "
    ):
        olmo3.Compute(attention="flash")
    with pytest.raises(
        ValueError, match="^Compute.remat 'some': expected one of auto, none, full, save_matmuls, "
    ):
        olmo3.Compute(remat="some")
    with pytest.raises(ValueError, match="^Compute.scan_unroll 0: expected an integer >= 1$"):
        olmo3.Compute(scan_unroll=0)


def test_remat_auto_is_refused_by_the_model_until_a_run_decides_it():
    """--remat auto is train.py's to decide (fitting_microbatches); a model handed it undecided says so."""
    model = olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(0), compute=olmo3.Compute(remat="auto"))
    with pytest.raises(
        ValueError, match="^Compute.remat 'auto' is decided per run .*: expected one of none, "
    ):
        model(jnp.zeros((1, 8), jnp.int32))


OLMO_CORE_PRESETS = {"190m": "olmo3_190M", "1b": "olmo3_1B", "7b": "olmo3_7B", "32b": "olmo3_32B"}


def olmo_core_fields(theirs, tokenizer) -> dict:
    """OLMo-core's TransformerConfig and TokenizerConfig read as our Olmo3Config's fields."""
    attn, n = theirs.block.sequence_mixer, theirs.n_layers
    pattern = attn.sliding_window
    sliding = [i for i in range(n) if pattern.should_use_swa(i, n)]
    (window,) = {pattern.get_window_size(i, n) for i in sliding}
    return dict(
        vocab_size=tokenizer.vocab_size,
        d_model=theirs.d_model,
        n_layers=n,
        n_heads=attn.n_heads,
        n_kv_heads=attn.n_kv_heads or attn.n_heads,  # None: one kv head per head
        head_dim=attn.head_dim or theirs.d_model // attn.n_heads,  # None: d_model / n_heads
        mlp_hidden=theirs.block.feed_forward.hidden_size,
        layer_types=tuple(SLIDING if i in sliding else FULL for i in range(n)),
        sliding_window=window,
        rope_sliding=olmo3.Rope(theta=float(attn.rope.theta)),
        rope_full=olmo3.Rope(theta=float(attn.rope.theta)),
        norm_eps=theirs.block.layer_norm.eps,
        init_std=theirs.init_std,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@pytest.mark.parametrize("name", OLMO_CORE_PRESETS)
def test_presets_are_olmo_core_s_olmo3_models(name):
    # OLMo-core's TransformerConfig only describes the model (nothing is allocated until .build()).
    from olmo_core.data import TokenizerConfig
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    tokenizer = TokenizerConfig.dolma2()
    theirs = getattr(TransformerConfig, OLMO_CORE_PRESETS[name])(vocab_size=tokenizer.padded_vocab_size())
    ours = olmo3.MODELS[name]
    expected = olmo_core_fields(theirs, tokenizer)
    assert {field: getattr(ours, field) for field in expected} == expected
    assert ours.padded_vocab == theirs.vocab_size
    assert olmo3.count_params(olmo3.abstract(ours)) == theirs.num_params
    # What our model hard-wires rather than configures: the block, the norms, RoPE, no biases, an untied head.
    attn = theirs.block.sequence_mixer
    assert theirs.block.name == TransformerBlockType.reordered_norm
    assert attn.qk_norm.eps == theirs.lm_head.layer_norm.eps == ours.norm_eps
    assert not attn.use_head_qk_norm  # one norm over the whole q (and k) projection
    assert attn.rope.scaling is None and attn.rope.full_precision and not attn.rope.no_global_rope
    assert not (
        attn.bias or theirs.block.feed_forward.bias or theirs.lm_head.bias or theirs.tie_word_embeddings
    )


def test_init_is_olmo_core_truncated_normal():
    model = olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(0))
    w = np.asarray(model.layers.mlp.gate_proj)
    assert np.abs(w).max() <= 0.06 + 1e-7 and np.abs(w).max() > 0.055  # cut at 3 sigma, not 2
    assert abs(w.std() - 0.02 * 0.9866) < 3e-4  # the std of N(0, 0.02) truncated at +-3 sigma
    assert (np.asarray(model.layers.self_attn.q_norm) == 1).all() and (np.asarray(model.norm) == 1).all()


def test_non_periodic_pattern_is_refused():
    irregular = (SLIDING, SLIDING, SLIDING, FULL) * 2 + (SLIDING, FULL, SLIDING, SLIDING)
    with pytest.raises(ValueError, match="not a repeating pattern"):
        dataclasses.replace(olmo3.MODELS["tiny"], n_layers=12, layer_types=irregular)
    assert dataclasses.replace(olmo3.MODELS["tiny"], n_layers=12, layer_types=(SLIDING, FULL) * 6).period == 2


def test_greedy_sampling_matches_transformers_generate(tmp_path):
    hf = make_hf(tmp_path, vocab=1000)
    model = ckpt.load_hf(tmp_path)
    prompt = tokens(n=6, vocab=1000, batch=1)
    with torch.no_grad():
        theirs = hf.generate(torch.as_tensor(prompt), max_new_tokens=10, do_sample=False).numpy()[0]
    ours = olmo3.sample(model, jnp.asarray(prompt[0]), 10, key=jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), theirs)
    top1 = olmo3.sample(model, jnp.asarray(prompt[0]), 10, key=jax.random.key(3), temperature=1.0, top_k=1)
    np.testing.assert_array_equal(np.asarray(top1), theirs)  # top-k with k=1 is greedy
