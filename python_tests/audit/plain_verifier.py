"""A verifier of the audit's protocol written the way a user would write one: plain PyTorch,
vectorised over the rows, torch's global random numbers (no per-row seeds).  The audit's tests
pass it to ``specdec audit`` as ``plain_verifier.py:verify``, and copies of it with one line
changed (a slip in the acceptance test, the residual or the bonus draw) must fail."""

import torch


def warp(logits, temperature, top_k, top_p, min_p):
    """[B, K+1, V] float64 probabilities: temperature, top-k, top-p, min-p (transformers' order);
    a greedy row (temperature 0) is the point mass on the argmax."""
    B, K1, V = logits.shape
    greedy = temperature == 0
    s = logits.double() / torch.where(greedy, 1.0, temperature.double())[:, None, None]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    kth = s.sort(-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(B, K1, 1))
    s = s.masked_fill(s < kth, float("-inf"))
    srt, order = s.sort(-1, descending=True)
    ps = torch.softmax(srt, -1)
    drop_sorted = (ps.cumsum(-1) - ps) >= top_p.double()[:, None, None]
    s = s.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    p = torch.softmax(s, -1)
    s = s.masked_fill(p < min_p.double()[:, None, None] * p.amax(-1, keepdim=True), float("-inf"))
    p = torch.softmax(s, -1)
    argmax = torch.nn.functional.one_hot(logits.argmax(-1), V).double()
    return torch.where(greedy[:, None, None], argmax, p)


def verify(target_logits, draft_tokens, draft_probs, params):
    B, K1, V = target_logits.shape
    K = K1 - 1
    kb = params.num_draft_tokens.long()
    rows = torch.arange(B)
    greedy = params.temperature == 0
    cols = torch.arange(K1)
    bad_logits = (~torch.isfinite(target_logits).all(-1) & (cols[None, :] <= kb[:, None])).any(-1)
    bad_ids = (((draft_tokens < 0) | (draft_tokens >= V)) & (cols[None, :K] < kb[:, None])).any(-1)
    invalid = bad_logits | bad_ids
    p = warp(torch.nan_to_num(target_logits, nan=0.0, posinf=0.0), params.temperature, params.top_k,
             params.top_p, params.min_p)
    x_all = draft_tokens.long().clamp(0, V - 1)
    onehot = torch.nn.functional.one_hot(x_all, V).double()  # [B, K, V]
    q = onehot.clone()
    if draft_probs is not None:
        q = torch.zeros(B, K, V, dtype=torch.float64)
        q[..., :draft_probs.shape[-1]] = draft_probs.double()
    q = torch.where(greedy[:, None, None], onehot, q)
    tokens = torch.full((B, K1), -1, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int64)
    alive = torch.ones(B, dtype=torch.bool)
    for j in range(K):
        live = alive & (j < kb)
        x = x_all[:, j]
        px = p[rows, j, x]
        qx = q[rows, j, x]
        u = torch.rand(B, dtype=torch.float64)
        accept = live & (u * qx < px)
        tokens[accept, j] = x[accept]
        num += accept.long()
        reject = live & ~accept
        residual = (p[:, j] - q[:, j]).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, j])
        if reject.any():
            tokens[reject, j] = torch.multinomial(residual[reject], 1)[:, 0]
        alive = alive & ~reject
    bonus = alive & (num == kb)
    pb = p[rows, kb]
    if bonus.any():
        tokens[bonus, kb[bonus]] = torch.multinomial(pb[bonus], 1)[:, 0]
    tokens[invalid] = -1
    num[invalid] = -1
    return tokens, num
