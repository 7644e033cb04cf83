"""Tolerances for floating-point results computed in two orders: sharded against one device, per rank against
the whole batch, ours against torch, transformers or OLMo-core. The CPU a test runs on picks the order (vector
width, FMA contraction, threads), so each tolerance comes from the arithmetic, not from what one CPU meets.

The rule: a sum of n terms rounds each of its partial sums by at most half an ulp, so two orders of it differ
by at most eps * n * (the size of its partial sums), eps that of the dtype it adds in (sum_tol). Where the
terms have one sign (a softmax's denominator, a norm's mean square) the partial sums never pass the total and
the roundings, of either sign, add as a random walk: sqrt(n) terms' worth. A model chains sums (projections,
norms, the softmax's, layer after layer) whose worst cases are independent of one another, so they add in
quadrature (chain): model_terms, grad_terms and loss_terms count them for an Olmo3Config. A tolerance tighter
than its bound passes only on the CPUs whose orders happen to agree; one far looser stops telling a bug from
rounding."""

import math

import numpy as np

FP32 = float(np.finfo(np.float32).eps)  # 2^-23


def sum_tol(n_terms: float, scale: float = 1.0, eps: float = FP32) -> float:
    """The most two orders of a sum of `n_terms` terms differ by, its partial sums up to `scale` (1: a
    relative tolerance)."""
    return eps * n_terms * float(scale)


def chain(*terms: float) -> float:
    """The n of a chain of sums of `terms` terms each, their worst cases independent: in quadrature."""
    return math.sqrt(sum(n * n for n in terms))


def attention_terms(head_dim: int, keys: int) -> float:
    """An attention output: a score (head_dim terms), the softmax's denominator (keys, one sign), the values'
    weighted sum (keys)."""
    return chain(head_dim, math.sqrt(keys), keys)


def model_terms(cfg, seq: int) -> float:
    """One logit of an Olmo3Config model over `seq` tokens: each layer's q, k, v projections (d_model), their
    norms (a mean square over n_heads * head_dim), attention over the keys the layer sees, the output
    projection, the post-attention norm, the MLP's up (d_model) and down (mlp_hidden) and its post-norm; then
    the final norm and the LM head (d_model)."""
    d, inner = cfg.d_model, cfg.n_heads * cfg.head_dim
    terms = []
    for t in cfg.layer_types:
        keys = min(seq, cfg.window(t) or seq)
        terms += [d, math.sqrt(inner), attention_terms(cfg.head_dim, keys), inner, math.sqrt(d)]
        terms += [d, cfg.mlp_hidden, math.sqrt(d)]
    return chain(*terms, math.sqrt(d), d)


def grad_terms(cfg, seq: int, tokens: int) -> float:
    """A parameter's gradient: the forward chain, the loss's softmax over the padded vocabulary (one sign), the
    backward chain (the forward's sums transposed) and the sum over the `tokens` a weight's gradient adds up
    (of either sign: its worst case)."""
    return chain(model_terms(cfg, seq), math.sqrt(cfg.padded_vocab), model_terms(cfg, seq), tokens)


def token_terms(cfg, seq: int) -> float:
    """One token's loss (or log-probability): the forward chain and the softmax over the padded vocabulary."""
    return chain(model_terms(cfg, seq), math.sqrt(cfg.padded_vocab))


def mean_terms(per_item: float, items: int) -> float:
    """A mean (or sum) over `items` values of one sign (a loss over tokens), each `per_item` terms deep: the
    items' worst cases are independent, so they shrink as 1 / sqrt(items) in the mean, and the sum over them
    adds sqrt(items); 2 more: the scale 1 / items rounded to fp32, and the product."""
    return chain(per_item / math.sqrt(items), math.sqrt(items)) + 2


def loss_terms(cfg, seq: int, tokens: int) -> float:
    """A mean loss over `tokens` tokens of `seq`-token rows."""
    return mean_terms(token_terms(cfg, seq), tokens)
