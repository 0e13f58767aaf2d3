"""Tree drafting in the decoding loop: ``SpeculativeDecoder(tree=...)``.

One step, for one row:

1. the draft catches up on the tokens it has not seen (the last emitted one at least) and gives
   q at the root (the last token of the sequence);
2. the tree grows one depth at a time: every node of the frontier gets its children from the
   draft's q at that node, sampled without replacement (Gumbel-top-k on log q) when sampling, the
   draft's top-k when greedy; the draft runs one forward per depth over the whole new level, with
   a tree attention mask (a node sees the prefix, its ancestors and itself) and position ids
   prefix + depth, appending the level to its cache;
3. the target runs one forward over the root and every node with the same tree mask, and
   ``fused_verify_tree`` verifies the tree exactly (recursive rejection sampling for sampled
   children, the residual with each rejected child removed for top-k children);
4. both caches keep the prefix plus the accepted path (``gather_dynamic_cache_`` moves the path's
   columns to the prefix end), and the emitted tokens are the path and one more token.

Tree shapes: static, as branching factors per depth (``(4, 2, 2, 1)``: 4 children of the root, 2
of each of those, ...), or dynamic (``TreeShape.dynamic(nodes, depth, branch)``: at each depth the
``nodes / depth`` slots go, ``branch`` at a time, to the frontier nodes whose paths are the most
probable under the draft, EAGLE-2's idea).  Which nodes get children is decided before the
children are drawn (``_allocate``): pruning drawn children by their own probability, as EAGLE-2
does for its greedy trees, would bias a sampled tree (the siblings would no longer be draws
without replacement from q), so it is not done.  Rows run one after the other
(batch 1 per row).  The masks go through Hugging Face's attention interface as 4D masks, which
models of the Llama family take (llama, mistral, qwen2, qwen3; eager and sdpa attention); other
architectures are refused by name.  The draft's vocabulary restriction (``draft_vocab``) and the
lean decode step are not used here: both models run their own forward over the whole vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.kv.cache import crop_cache_, gather_dynamic_cache_, new_cache
from ..ops.tree import fused_verify_tree
from .emit import append_row, cut_row
from .state import GenerationResult
from .stats import DecodingStats

__all__ = ["TreeShape", "check_tree_arguments", "check_tree_model", "generate_tree", "parse_tree", "run_tree"]

_ATTENTION = ("eager", "sdpa")
_MAX_TREE_NODES = 256
# model types whose attention takes a 4D mask and position ids as given (others are refused by name)
_TREE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class TreeShape:
    """A static tree (``branching``) or a dynamic one (``nodes`` kept per step over ``depth``
    levels, each frontier node proposing ``branch`` children)."""

    branching: tuple = ()
    nodes: int = 0
    depth: int = 0
    branch: int = 0

    def __post_init__(self):
        if self.branching:
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.branching):
                raise ValueError(f"a static tree's branching factors must be ints >= 1, got {self.branching!r}")
        else:
            for name in ("nodes", "depth", "branch"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"a dynamic tree's {name} must be an int >= 1, got {v!r}")
            if self.nodes < self.depth:
                raise ValueError(f"a dynamic tree's nodes must be >= its depth ({self.depth}), got {self.nodes}")

    @staticmethod
    def dynamic(nodes: int, depth: int, branch: int) -> "TreeShape":
        return TreeShape(nodes=nodes, depth=depth, branch=branch)

    @property
    def max_depth(self) -> int:
        return len(self.branching) if self.branching else self.depth

    @property
    def max_nodes(self) -> int:
        if not self.branching:
            return self.nodes
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total

    def describe(self) -> str:
        if self.branching:
            return ",".join(str(b) for b in self.branching)
        return f"dynamic:{self.nodes},{self.depth},{self.branch}"


def parse_tree(spec) -> Optional[TreeShape]:
    """None, a ``TreeShape``, branching factors (``(4, 2, 2, 1)`` or ``"4,2,2,1"``), or
    ``"dynamic:N,D,B"``; errors name the argument."""
    if spec is None or isinstance(spec, TreeShape):
        shape = spec
    elif isinstance(spec, str) and spec.startswith("dynamic:"):
        parts = spec[len("dynamic:"):].split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"tree must be 'dynamic:NODES,DEPTH,BRANCH' (three positive ints), got {spec!r}")
        shape = TreeShape.dynamic(*(int(p) for p in parts))
    else:
        if isinstance(spec, str):
            parts = [p.strip() for p in spec.split(",")]
            if not parts or not all(p.isdigit() for p in parts):
                raise ValueError(f"tree must be branching factors per depth such as '4,2,2,1', got {spec!r}")
            spec = tuple(int(p) for p in parts)
        if not isinstance(spec, (tuple, list)) or not spec or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in spec):
            raise ValueError(f"tree must be a non-empty sequence of branching factors >= 1 such as (4, 2, 2, 1), "
                             f"got {spec!r}")
        shape = TreeShape(branching=tuple(spec))
    if shape is not None and shape.max_nodes > _MAX_TREE_NODES:
        raise ValueError(f"tree must have at most {_MAX_TREE_NODES} nodes, got {shape.max_nodes} ({shape.describe()})")
    return shape


def check_tree_model(model, name: str) -> None:
    """Refuse, by name, a model whose attention cannot take a 4D tree mask."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in _TREE_MODEL_TYPES:
        raise ValueError(f"tree drafting takes {name} of model type {' / '.join(_TREE_MODEL_TYPES)} "
                         f"(rotary positions and a 4D mask taken as given); {type(model).__name__} is {model_type!r}")
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in _ATTENTION:
        raise ValueError(f"tree drafting needs {name}'s attention to take a 4D mask ({' or '.join(_ATTENTION)}); "
                         f"{type(model).__name__} uses {impl!r}")


def _forward(runner, cache, ids, positions, mask, start, keep: Optional[int] = None):
    """One forward appending ids [1, q] at cache column ``start`` with positions [1, q] and a
    boolean 4D mask [1, 1, q, start + q] (True = attend); returns the logits of the last ``keep``
    columns (all: None) [1, keep, V] fp32.  Ids past the model's vocabulary (a target's padded
    one, fed to its draft) are clamped to its last id, as the chain loop feeds them: the draft's
    proposals, not the output's law, depend on it."""
    model = runner.model
    ids = ids.clamp(max=runner.vocab_size - 1)
    dtype = next(model.parameters()).dtype
    add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    kwargs = {runner.cache_kw: cache, "use_cache": True, "position_ids": positions, "attention_mask": add}
    if runner.has_cache_position:
        kwargs["cache_position"] = torch.arange(start, start + ids.shape[1], device=ids.device)
    if keep is not None and runner.has_logits_to_keep:
        kwargs["logits_to_keep"] = keep
    logits = model(input_ids=ids, **kwargs).logits
    return (logits if keep is None else logits[:, -keep:]).float()


def _tree_mask(parents: list, prefix: int, new: list, seen: list) -> torch.Tensor:
    """[1, 1, len(new), prefix + len(seen) + len(new)] bool: node new[i] sees the prefix columns,
    the columns of its ancestors among ``seen`` (nodes already in the cache, in column order) and
    itself.  parents: every node's parent (-1 = the root, which is the prefix's last column)."""
    col = {n: prefix + i for i, n in enumerate(seen + new)}
    m = torch.zeros(len(new), prefix + len(seen) + len(new), dtype=torch.bool)
    m[:, :prefix] = True
    for i, n in enumerate(new):
        a = n
        while a >= 0:
            m[i, col[a]] = True
            a = parents[a]
    return m[None, None]


def _children(logq: torch.Tensor, m: int, sample: bool, g: torch.Generator) -> list:
    """m distinct tokens from q (log q [V] fp32): sampled without replacement (Gumbel-top-k) or the
    top m; never more than q's support (a child of probability 0 is not proposed)."""
    m = min(m, int(torch.isfinite(logq).sum()))
    if m <= 0:
        return []
    score = logq
    if sample:
        u = torch.rand(logq.shape, generator=g, dtype=torch.float64).clamp_(min=1e-300)  # the row's CPU generator
        score = logq.double() - torch.log(-torch.log(u)).to(logq.device)
    return torch.topk(score, m).indices.tolist()


class _Tree:
    """The tree of one step: tokens, parents, depths and, per node, the draft's q over its
    children (filled as the tree grows)."""

    def __init__(self):
        self.tokens, self.parents, self.depths, self.logp = [], [], [], []  # logp: the path's draft log-prob

    def add(self, token: int, parent: int, logp: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.logp.append(logp)
        return len(self.tokens) - 1


def check_tree_arguments(streamer, criteria, procs, draft_confidence, verbose, grammar=None) -> None:
    """Refuse by name what tree drafting does not take yet."""
    for name, value in (("streamer", streamer), ("stopping_criteria", criteria), ("logits processors", procs),
                        ("grammar", grammar)):
        if value is not None:
            raise ValueError(f"tree drafting does not take {name} yet; got one (use tree=None)")
    if draft_confidence:
        raise ValueError(f"tree drafting does not take draft_confidence, got {draft_confidence}")
    if verbose:
        raise ValueError("tree drafting does not print a trace yet: got verbose=True")


def generate_tree(parts, st, after_step=None):
    """A started call (``state.start_state``) decoded with tree steps, to its ``GenerationResult``;
    what tree drafting does not take is refused by name.  after_step: ``run_tree``'s."""
    h = st.hooks
    check_tree_arguments(h.streamer, h.criteria, h.procs, st.settings.draft_confidence, h.verbose, h.grammar)
    parts.refresh()
    with parts.linear_layers(), torch.inference_mode():
        stats = run_tree(parts, st, after_step)
    if h.pbar is not None:
        h.pbar.close()
    return GenerationResult.of(st, parts.tokenizer, stats)


def run_tree(parts, st, after_step=None) -> DecodingStats:
    """Decode every row of a started state with the tree steps of ``parts.tree``: the generated
    ids and finish reasons go into ``st``; returns the DecodingStats.  after_step: called after
    every step with (target cache, draft cache, the row's ids, the draft cache's length): the
    tests check both caches against fresh forwards through it."""
    dev, shape, tokenizer = parts.device, parts.tree, parts.tokenizer
    t_run = time.perf_counter()
    T = st.settings.temperature
    sample = T > 0
    stats = DecodingStats()
    hist = [0] * (shape.max_depth + 1)
    t_draft = t_target = t_prefill = 0.0
    n_draft_fwd = n_nodes = 0
    for p in st.rows:
        if st.finish[p] is not None:
            continue
        seq = st.seqs[p]  # the row's ids, extended by append_row
        gen = st.generated[p]
        budget = st.budget_host[p]
        g = torch.Generator().manual_seed(int(st.settings.seeds[p]) & (2**63 - 1))
        t0 = time.perf_counter()
        tc, dc = new_cache(parts.target), new_cache(parts.draft)
        L = len(seq)  # the sequence; the caches hold seq[:L - 1] after the prefill
        if L > 1:
            pre = torch.tensor([seq[:-1]], device=dev)
            pos = torch.arange(L - 1, device=dev)[None]
            causal = torch.ones(L - 1, L - 1, dtype=torch.bool, device=dev).tril()[None, None]
            _forward(parts.target_runner, tc, pre, pos, causal, 0, keep=1)
        dctx = st.settings.draft_context  # the draft's context when shorter than the target's (None: no limit)
        drafting = dctx is None or L - 1 < dctx  # the root's position must lie inside it
        if L > 1 and drafting:
            _forward(parts.draft_runner, dc, pre, pos, causal, 0, keep=1)
        ld = L - 1  # the draft cache's length
        t_prefill += time.perf_counter() - t0
        step = 0
        while st.finish[p] is None:
            ta = time.perf_counter()
            room = budget - len(gen)  # tokens this row may still emit (>= 1)
            drafting = drafting and (dctx is None or L - 1 < dctx)
            # no node deeper than the budget leaves room for, nor past the draft's context
            depth_cap = min(shape.max_depth, room - 1) if drafting else 0
            if dctx is not None and drafting:
                depth_cap = min(depth_cap, dctx - L + 1)
            logits = None
            if depth_cap > 0:
                # 1. the draft catches up (seq[ld:], the root last) and gives q at the root
                todo = torch.tensor([seq[ld:]], device=dev)
                q_len = todo.shape[1]
                causal = torch.ones(q_len, ld + q_len, dtype=torch.bool, device=dev).tril(ld)[None, None]
                logits = _forward(parts.draft_runner, dc, todo, torch.arange(ld, L, device=dev)[None], causal, ld,
                                  keep=1)[0, -1]
                n_draft_fwd += 1
                ld = L
            tree = _Tree()
            q_rows = {} if logits is None else {-1: _draft_q(logits, T)}  # node -> the draft's q over its children
            frontier = [-1]
            seen = []  # nodes already in the draft's cache, in column order
            for d in range(depth_cap):
                level = []
                for f, m in _allocate(tree, frontier, shape, d):
                    lq = q_rows[f].log()
                    base = 0.0 if f < 0 else tree.logp[f]
                    for c in _children(lq, m, sample, g):
                        level.append(tree.add(c, f, base + float(lq[c])))
                if not level:
                    break
                if d + 1 < depth_cap:  # the draft's q at the new level, for the next depth
                    ids = torch.tensor([[tree.tokens[n] for n in level]], device=dev)
                    pos = torch.tensor([[L - 1 + tree.depths[n] for n in level]], device=dev)
                    mask = _tree_mask(tree.parents, L, level, seen).to(dev)
                    out = _forward(parts.draft_runner, dc, ids, pos, mask, L + len(seen))[0]
                    n_draft_fwd += 1
                    for i, n in enumerate(level):
                        q_rows[n] = _draft_q(out[i], T)
                    seen += level
                frontier = level
            tb = time.perf_counter()
            # 3. the target scores the root and every node in one forward
            N = len(tree.tokens)
            ids = torch.tensor([[seq[-1]] + tree.tokens], device=dev)
            pos = torch.tensor([[L - 1] + [L - 1 + d for d in tree.depths]], device=dev)
            mask = torch.ones(N + 1, L - 1 + N + 1, dtype=torch.bool)
            mask[:, L - 1:] = False
            mask[:, L - 1] = True  # the root
            mask[1:, L:] = _tree_mask(tree.parents, 0, list(range(N)), [])[0, 0]
            tlogits = _forward(parts.target_runner, tc, ids, pos, mask[None, None].to(dev), L - 1)
            V = tlogits.shape[-1]
            nodes = torch.tensor([tree.tokens], dtype=torch.int64, device=dev).view(1, N)
            parents = torch.tensor([tree.parents], dtype=torch.int64, device=dev).view(1, N)
            q = None
            if sample:
                q = torch.zeros(1, N + 1, V, device=dev)
                for n, row in q_rows.items():
                    q[0, n + 1, :row.shape[0]] = row
            out = fused_verify_tree(tlogits, nodes, parents, q, temperature=T, top_k=st.settings.top_k,
                                    top_p=st.settings.top_p, min_p=st.settings.min_p, seed=int(st.settings.seeds[p]),
                                    offset=step,
                                    max_depth=max(tree.depths, default=0))
            na = int(out.num_accepted[0])
            t_target += time.perf_counter() - tb
            t_draft += tb - ta
            step += 1
            n_nodes += N
            stats.iterations += 1
            if na < 0:
                st.finish[p] = "nonfinite"
                break
            path = out.path[0, :na].tolist()
            new = out.tokens[0, :na + 1].tolist()
            hist[na] += 1
            # k: the tree's nodes; num_draft: its depth (the longest path that can be accepted)
            stats.history.append(dict(k=N, rows=[p], num_draft=[max(tree.depths, default=0)], accepted=[na]))
            stats.accepted_tokens += na
            # 4. both caches keep the prefix and the path
            src = torch.tensor([[L - 1] + [L + n for n in path]], device=dev)
            gather_dynamic_cache_(tc, src, torch.tensor([1 + na], device=dev), torch.tensor([L - 1], device=dev))
            crop_cache_(tc, L + na)
            if logits is not None:  # the draft ran this step: its cache holds seq[:L] and the levels it saw
                col = {n: L + i for i, n in enumerate(seen)}
                kept = [col[n] for n in path if n in col]  # path nodes the draft has seen (not the last level)
                if kept:
                    gather_dynamic_cache_(dc, torch.tensor([kept], device=dev), torch.tensor([len(kept)], device=dev),
                                          torch.tensor([L], device=dev))
                ld = L + len(kept)
                crop_cache_(dc, ld)
            # emit, stop: as the chain loop cuts a row (emit.py)
            new, reason = cut_row(st, tokenizer, p, new)
            append_row(st, p, new, reason)
            stats.generated_tokens += len(new)
            L = len(seq)
            if after_step is not None:
                after_step(tc, dc, seq, ld)
    total = time.perf_counter() - t_run
    stats.row_steps = stats.iterations
    reached = sum(min(h["accepted"][0] + 1, h["num_draft"][0]) for h in stats.history)
    stats.alpha = stats.accepted_tokens / reached if reached else None  # acceptance per depth reached
    stats.drafted_tokens = n_nodes
    stats.acceptance_rate = stats.accepted_tokens / n_nodes if n_nodes else None
    stats.accepted_length_histogram = hist
    stats.mean_tokens_per_target_call = stats.generated_tokens / stats.iterations if stats.iterations else None
    stats.mean_num_draft_tokens = n_nodes / stats.iterations if stats.iterations else None
    stats.draft_forwards = n_draft_fwd
    stats.draft_time_s, stats.target_time_s, stats.prefill_time_s = t_draft, t_target, t_prefill
    stats.total_time_s = total
    stats.tokens_per_s = stats.generated_tokens / total if total > 0 else None
    stats.time_per_draft_forward_s = t_draft / n_draft_fwd if n_draft_fwd else None
    stats.time_per_target_forward_s = t_target / stats.iterations if stats.iterations else None
    stats.finish_reasons = list(st.finish)
    return stats


def _draft_q(logits: torch.Tensor, T: float) -> torch.Tensor:
    """The draft's q over the children [V] fp32: softmax(logits / T) when sampling; greedy rows
    propose the top-k of the logits (returned as softmax(logits), whose order is the logits')."""
    return torch.softmax(logits.float() / (T if T > 0 else 1.0), -1)


def _allocate(tree: _Tree, frontier: list, shape: TreeShape, d: int) -> list:
    """[(frontier node, its number of children)] at depth d + 1.  Static: the shape's branching
    factor for every node.  Dynamic: the level's nodes / depth slots go to the frontier nodes of the
    highest path probability under the draft, ``branch`` each (EAGLE-2's idea).  The count is
    decided before the children are drawn, from their parents' probabilities only: a rule that
    kept a drawn child for its own probability would make the siblings no longer draws without
    replacement from q, and the tree's output would not be the target's."""
    if shape.branching:
        return [(f, shape.branching[d]) for f in frontier]
    slots = max(1, shape.nodes // shape.depth)
    order = sorted(frontier, key=lambda f: -(0.0 if f < 0 else tree.logp[f]))
    out = []
    for f in order:
        if slots <= 0:
            break
        m = min(shape.branch, slots)
        out.append((f, m))
        slots -= m
    return sorted(out)  # proposal order: the tree's node order
