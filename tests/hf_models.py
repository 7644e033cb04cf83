"""Tiny random transformers Olmo3ForCausalLM checkpoints: the independent reference for the model tests."""

import numpy as np
import torch
from transformers import Olmo3Config, Olmo3ForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


def make_hf(
    path,
    *,
    vocab=300,
    d=64,
    layers=4,
    heads=4,
    kv_heads=4,
    mlp=96,
    window=8,
    types=None,
    theta_sliding=10_000.0,
    theta_full=500_000.0,
    yarn=None,
    seed=0,
    save=True,
):
    """Build a random HF model with randomised norm weights (init leaves them at 1, which hides bugs)."""
    torch.manual_seed(seed)
    full = {"rope_type": "default", "rope_theta": theta_full}
    if yarn:
        full = {"rope_type": "yarn", "rope_theta": theta_full, **yarn}
    cfg = Olmo3Config(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        sliding_window=window,
        layer_types=types or [SLIDING if (i + 1) % 4 else FULL for i in range(layers)],
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": theta_sliding}, FULL: full},
        pad_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    model = Olmo3ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    if save:
        model.save_pretrained(path)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def markov_tokens(vocab, n, batch, seed=0):
    """Sequences from a fixed random bigram chain with a few likely successors per token: learnable."""
    rng = np.random.default_rng(1234)
    successors = rng.integers(0, vocab, (vocab, 3))
    rng = np.random.default_rng(seed)
    out = np.zeros((batch, n), np.int64)
    out[:, 0] = rng.integers(0, vocab, batch)
    for t in range(1, n):
        out[:, t] = successors[out[:, t - 1], rng.choice(3, batch, p=[0.8, 0.15, 0.05])]
    return out


def train_briefly(model, steps=60, seq=64, batch=8):
    """A few Adam steps on the chain, so predictions are confident as a trained checkpoint's are."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        ids = torch.as_tensor(markov_tokens(model.config.vocab_size, seq, batch, seed=step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()
