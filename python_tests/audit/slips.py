"""One-line slips of ``plain_verifier.py``: (name, the line as written, the line with the slip).
Each copy of the verifier with one of them must fail ``specdec audit`` at --quick size."""

SLIPS = [
    ("accept_ignores_q", "accept = live & (u * qx < px)", "accept = live & (u < px)"),
    ("accept_inverted", "accept = live & (u * qx < px)", "accept = live & (u * px < qx)"),
    ("accept_q_of_position_0", "qx = q[rows, j, x]", "qx = q[rows, 0, x]"),
    ("accept_p_of_next_position", "px = p[rows, j, x]", "px = p[rows, min(j + 1, K), x]"),
    ("accept_ignores_num_draft_tokens", "live = alive & (j < kb)", "live = alive"),
    ("residual_from_p", "residual = (p[:, j] - q[:, j]).clamp(min=0)", "residual = p[:, j].clone()"),
    ("residual_abs", "residual = (p[:, j] - q[:, j]).clamp(min=0)", "residual = (p[:, j] - q[:, j]).abs()"),
    ("residual_q_of_next_position", "residual = (p[:, j] - q[:, j]).clamp(min=0)",
     "residual = (p[:, j] - q[:, min(j + 1, K - 1)]).clamp(min=0)"),
    ("bonus_from_previous", "pb = p[rows, kb]", "pb = p[rows, (kb - 1).clamp(min=0)]"),
    ("bonus_at_position_K", "pb = p[rows, kb]", "pb = p[rows, K]"),
    ("bonus_unwarped", "pb = p[rows, kb]", "pb = torch.softmax(target_logits[rows, kb].double(), -1)"),
    ("bonus_from_last_residual", "pb = p[rows, kb]", "pb = residual"),
]
