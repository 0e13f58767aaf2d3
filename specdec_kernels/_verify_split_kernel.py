"""The Triton kernel of ``fused_verify``: one launch, the vocabulary split across programs.

Work decomposition.  Position i of row b is cut into NC = ceil(V / CHUNK) chunks of CHUNK
tokens (a constant of the launcher, never a function of B, so a row's arithmetic does not
depend on the batch).  A work item covers TILES consecutive chunks (1 by default; NI =
ceil(NC / TILES) items a position), streamed with software pipelining.  The launch holds two
kinds of work item, numbered in this order (written below for TILES = 1):

- stage 1, item (b, i, c) for every row, position i <= K and chunk c (B * (K+1) * NI items):
  the chunk's max, first argmax, sum of exp(s - chunk max) and non-finite count (greedy rows:
  max and argmax only, no exponential), and with top-k/top-p/min-p the chunk's CAP largest order
  keys; written to a partial record;
- stage 2, item (b, c) for every row and chunk (B * NI items): the float64 mass of chunk c's
  final-draw weights (residual max(0, p - q) after a rejection, p for the bonus) at the row's
  stop position j.

Each program claims items from a ticket counter (atomic add) until none is left, so items are
*started* in number order whatever the grid and the hardware's scheduling.  Combines happen
without a second launch, by the last program to arrive (an arrival counter, acq_rel):

- the last stage-1 item of position (b, i) combines its NC chunk partials **in chunk order** (the
  result does not depend on which program arrives last) into the position's (m, S, thr, argmax,
  bad): top-k and top-p from the chunks' candidate keys (below);
- the last position of row b to be combined runs the acceptance chain (all K_b tests at once,
  float64, the same Philox counters as before), giving j; a greedy or invalid row is written out
  here, then the row's ready flag is released;
- a stage-2 item waits (spins, acquire) on its row's ready flag; the last stage-2 item of a row
  locates the chunk holding the sampled token from the NC chunk masses (float64, chunk order),
  rescans that one chunk (hot in L2) for the inverse CDF, and writes the row.

No deadlock under any scheduling: stage-1 items never wait; a stage-2 item waits only for its
row's stage-1 items, which all have smaller numbers, so each was claimed by a program that is
already running and that finishes it without waiting; hence every flag is set.  This holds for
any grid size and any number of co-resident programs (one program doing every item in order
included: Triton's interpreter).  Every counter and flag is reset by the last program to use it
in the launch (the ticket by the last program to leave), so no host memset is needed and the
launch can be captured in a CUDA graph and replayed: the workspace is persistent per device and
stream (see ``verify._workspace``).

top-k / top-p in one pass: stage 1 writes, per chunk, its largest order keys: every key above
t_c, the top of the 16-bit key bucket (sign, exponent, 7 mantissa bits) that holds the chunk's
CAP-th largest key, found by radix select (two 256-bin histograms of the keys in registers);
fewer than CAP keys lie above it (the whole chunk when it has at most CAP tokens, t_c =
INT32_MIN).  Every token with a key above t_sat = max_c t_c is then in the lists, so a threshold
found among the candidates and lying above t_sat is the position's own: the k-th largest
candidate (radix select, four histograms) when it is above t_sat, and the top-p cut then over
the top-k set (each kept key's strictly-greater mass at once, in one CAP x CAP block), or, with
top-p alone, bisected over the candidates' masses from t_sat up.  That decides top-k 50 on
logits without a tie across t_sat and top-p sets of fewer than ~CAP tokens of any chunk.
Otherwise (k above what the lists hold, ties at t_sat, a large top-p set) the position's last
program bisects over the whole position as the one-program-per-row kernel does (up to ~65 reads
of it): exact, slow, and said in the README.  The semantics are the reference's: ties at the
top-k boundary kept, top-p's strict boundary, the smallest key whose strictly-greater mass is <
top_p * S over the top-k set.

min-p (HAS_MIN_P; after top-k and top-p, transformers' order) keeps the tokens with s >= T,
T = fl32(m + fl32(ln min_p)) (``reference.min_p_threshold``; the float64 log by the steps of
``reference.min_p_log``, ``_min_p_key``): a threshold on the order key from the position's max m
alone, known at the combine, so no pass over the logits finds it.  Its kept set is an upper set
holding the maximum, so it composes with top-k/top-p's as the higher of the two thresholds.  The
kept mass S comes from the candidate lists when that threshold lies above t_sat (the lists hold
every kept token: the usual case, a min-p set of fewer than ~CAP tokens of any chunk); otherwise
the combining program sums exp(s - m) over the position's keys >= it in one pass (``scanned``),
one read where top-p's fallback bisects.

Memory traffic per row b with K_b drafts, V tokens, E-byte logits (4 fp32, 2 bf16/fp16), Vd
draft-vocabulary entries of 4 bytes, and NC chunks:

- stage 1 reads (K_b + 1) * V * E bytes once: every position a row uses, in parallel (positions
  past K_b are not read).  This is the floor: each decision needs the softmax of its position,
  and the positions are read in parallel rather than stopping at the first rejection, which a
  split launch cannot know in advance.  It writes 16 bytes per chunk (+ 4 * CAP with a warp);
- stage 2 reads position j's V * E bytes again (L2-hot on a GPU: it was read microseconds
  before) and, after a rejection with a full q, q_j's Vd * 4 bytes; it writes 12 bytes per chunk;
- the final draw rescans one chunk (CHUNK * (E + 4) bytes, L2-hot) and writes (K + 2) * 8 bytes;
- with top-k/top-p: no more reads of the logits when the candidate lists decide (above), the
  top-k set through CAP * 4 bytes of the workspace;
- min-p adds no read of the logits when its kept set lies in the candidate lists (a scalar min_p
  is passed by value; a [B] tensor's element is read once per item, as top_p's), the lists' 4 *
  CAP bytes a chunk as with top-k/top-p; one more read of a position (V * E bytes, by its
  combining program) only when its kept set overflows the lists;
- the combines read the partial records (16 bytes per chunk, 4 * CAP with a warp), L2-resident.

The engine-facing forms change no pass: the packed layout (PACKED) reads row b's positions from
logits row cu[b] + b and its drafts from cu[b] (two 4-8 byte reads of cu per item, the same bytes
of logits); probabilities in (PROBS) read the same V * E bytes, with no exponential; fp16/bf16
draft probabilities read Vd * 2 bytes instead of 4; log-probabilities (LOGPROBS) add one logit
read for the final token, 4 * (K + 1) bytes written per row, and the exponentials of greedy rows.

Draft logits in (DRAFT_LOGITS: ``draft_logits=``; draft_probs_ptr holds the draft's logits, Vd
entries of Ed bytes, 4 fp32 or 2 bf16/fp16), the one form that adds reads to a pass: q_i =
softmax(l_i / T) with the row's temperature, no top-k/top-p.  Each stage-1 item (b, i, c) of a
sampled row's draft position i < K_b also reduces chunk c of l_i / T (the same chunks as the
target's; a chunk past Vd reads nothing): its max, sum of exp(l / T - chunk max) and NaN/+inf
count, to three more per-chunk records; the position's combine makes (m_d, S_d, bad_d) in chunk
order as it does (m, S) for the target (bad_d: a NaN or +inf scaled logit, or none finite: q_i
is then NaN, as the reference's softmax of such a row, and makes the row invalid where it is
read).  The acceptance chain reads l_i(x_i) and takes q_i(x_i) = exp(l_i(x_i) / T - m_d) / S_d;
stage 2 computes q_j per token the same way from position j's draft logits.  Added traffic per
sampled row: K_b * Vd * Ed bytes read in stage 1 (every draft position, in parallel with the
target's positions: where draft_probs reads K_b entries, the logits' softmax needs the whole
row), 12 bytes written per draft-position chunk and read back by the combine (L2), 12 * (K + 1)
bytes of position records; after a rejection stage 2 reads q_j's Vd * Ed bytes of logits
(instead of Vd * 4 or 2 bytes of probabilities; L2-hot).  Greedy rows read no draft logits.

So a step reads about (K_b + 2) * V * E bytes of logits (+ Vd * 4 of q after a rejection; with
draft logits + K_b * Vd * Ed, and Vd * Ed after a rejection), all but (K_b + 1) * V * E (+ K_b *
Vd * Ed) of it from L2.  Greedy rows skip stage 2 and compute no exponential.

Block verification (BLOCK: ``method="block"``, Sun et al. 2025; ``reference.block_verify_reference``
defines it): the row's chain also computes p_0..p_K (float64, 8 * (K + 1) bytes written); stage
2 has an item per row, position i <= K_b and chunk (B * (K+1) * NI items), each writing the float64
mass of chunk c of max(0, p_i P_i - Q_i) (P at i = K_b) and its unusable-q count (16 bytes a
chunk); the row's last item reads those (16 * (K_b + 1) * NC bytes, L2), forms h_i and tau, and
draws the extra token from position tau's masses (one chunk rescanned).  Added traffic per sampled
row: every position's V * E bytes read a second time in stage 2 (K_b * V * E more than token
verification's one position, L2-hot) and q at every draft position, K_b * Vd * 4 bytes (2 for
bf16/fp16; with draft logits K_b * Vd * Ed more), where token verification reads q_j only after a
rejection.  So a block step reads about 2 (K_b + 1) V E + K_b Vd 4 bytes, half of the logits from
L2.  Greedy rows are verified token by token and read nothing more.

Randomness is counter-based, as in ``reference.philox_uniforms``: row b's numbers come from
Philox at counter ``(offset_b << 32) | c``: ``tl.rand`` (24 bits) with c = i + 1 for draft i's
test, and 53 bits of ``tl.randint4x`` at c = 0 for the final draw, whose inverse CDF sums in
float64 (chunk masses, then the chunk's cumulative sum).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._verify_kernel import _masked_mass, _order_key, _warp_full

_INT32_MAX = tl.constexpr(2147483647)
_INT32_MIN = tl.constexpr(-2147483648)
_FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # 2^-126, reference.FLT_MIN: the smallest temperature

# Bits of ``param_flags``: which per-row parameters are [B] tensors (else a scalar argument).
_P_NUM_DRAFT = tl.constexpr(1)
_P_TEMPERATURE = tl.constexpr(2)
_P_TOP_K = tl.constexpr(4)
_P_TOP_P = tl.constexpr(8)
_P_SEED = tl.constexpr(16)
_P_OFFSET = tl.constexpr(32)
_P_MIN_P = tl.constexpr(64)


@triton.jit
def _key_value(key):
    """The fp32 value of an order key (the inverse of ``_order_key``)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _param(flags, bit, ptr, stride, scalar, b, DTYPE: tl.constexpr):
    """Row b's value of a parameter given either as a [B] tensor (its bit set in flags) or as a
    scalar kernel argument (no device tensor made for it by the launcher), as DTYPE."""
    v = (tl.zeros([], DTYPE) + scalar).to(DTYPE)
    if (flags & bit) != 0:
        v = tl.load(ptr + b * stride).to(DTYPE)
    return v


@triton.jit
def _philox_key(b, flags, seed_ptr, seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar):
    """Row b's Philox seed and counter base (offset_b << 32; the low word is the draw's index)."""
    seed = _param(flags, _P_SEED, seed_ptr, seed_stride, seed_scalar, b, tl.int64) + b * seed_row_step
    counter_base = _param(flags, _P_OFFSET, off_ptr, off_stride, off_scalar, b, tl.int64) << 32
    return seed, counter_base


@triton.jit
def _row_params(b, K, V, flags,
                nd_ptr, nd_stride, nd_scalar, t_ptr, t_stride, t_scalar,
                k_ptr, k_stride, k_scalar, p_ptr, p_stride, p_scalar, mp_ptr, mp_stride, mp_scalar, cu_ptr, cu_stride,
                HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, PACKED: tl.constexpr,
                PROBS: tl.constexpr):
    """(kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p) of row b, as the
    reference's ``_row_parameters``; k_on / p_on / mp_on: the row's top-k / top-p / min-p is
    applied (min_p > 0 on a sampled row: min-p may change its distribution).  PACKED:
    K_b = cu[b + 1] - cu[b], and a row whose drafts are not within [0, nd_scalar) is unusable.
    PROBS (probabilities in): a temperature other than 0 or 1 is an unusable parameter, and
    1 / T = 1."""
    if PACKED:
        c0 = tl.load(cu_ptr + b * cu_stride).to(tl.int64)
        kb = tl.load(cu_ptr + (b + 1) * cu_stride).to(tl.int64) - c0
        out_of_bounds = (c0 < 0) | (c0 + kb > nd_scalar)  # nd_scalar: the number of drafts, sum_b K_b
    else:
        kb = _param(flags, _P_NUM_DRAFT, nd_ptr, nd_stride, nd_scalar, b, tl.int64)
        out_of_bounds = kb < 0
    temp = _param(flags, _P_TEMPERATURE, t_ptr, t_stride, t_scalar, b, tl.float32)
    greedy = temp == 0.0
    # (0, 2^-126): 1 / T overflows, or a subnormal T is flushed to 0; a packed row outside the
    # drafts reads nothing
    bad_param = ((temp != temp) | (temp < 0.0) | (temp == float("inf")) | ((temp > 0.0) & (temp < _FLT_MIN))
                 | (kb < 0) | (kb > K) | out_of_bounds)
    if PROBS:
        bad_param = bad_param | ((temp != 0.0) & (temp != 1.0))
    top_k = tl.full([], 0, tl.int64)
    top_p = tl.full([], 1.0, tl.float32)
    if HAS_TOP_K:
        top_k = _param(flags, _P_TOP_K, k_ptr, k_stride, k_scalar, b, tl.int64)
        bad_param = bad_param | (top_k < 0)
    if HAS_TOP_P:
        top_p = _param(flags, _P_TOP_P, p_ptr, p_stride, p_scalar, b, tl.float32)
        bad_param = bad_param | ~(top_p > 0.0) | (top_p > 1.0)
    min_p = tl.full([], 0.0, tl.float32)
    if HAS_MIN_P:
        min_p = _param(flags, _P_MIN_P, mp_ptr, mp_stride, mp_scalar, b, tl.float32)
        bad_param = bad_param | ~(min_p >= 0.0) | (min_p > 1.0)  # NaN fails the first test
    # IEEE division (div.full.f32, Triton's `/` on a GPU, may be 2 ulp off): 1 / T as the
    # reference computes it, once per row
    inv_t = tl.where(greedy | bad_param, 1.0, tl.math.div_rn(1.0, tl.where(greedy | bad_param, 1.0, temp)))
    k_on = ~greedy & (top_k > 0) & (top_k < V)
    p_on = ~greedy & (top_p < 1.0)
    mp_on = ~greedy & (min_p > 0.0)
    return kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p


# reference.min_p_log's constants: 2 / (2k + 1), k = 0..11 (ln f = 2 atanh z), ln 2, sqrt(2)
_LC0 = tl.constexpr(2.0)
_LC1 = tl.constexpr(0.6666666666666666)
_LC2 = tl.constexpr(0.4)
_LC3 = tl.constexpr(0.2857142857142857)
_LC4 = tl.constexpr(0.2222222222222222)
_LC5 = tl.constexpr(0.18181818181818182)
_LC6 = tl.constexpr(0.15384615384615385)
_LC7 = tl.constexpr(0.13333333333333333)
_LC8 = tl.constexpr(0.11764705882352941)
_LC9 = tl.constexpr(0.10526315789473684)
_LC10 = tl.constexpr(0.09523809523809523)
_LC11 = tl.constexpr(0.08695652173913043)
_LN2 = tl.constexpr(0.6931471805599453)
_SQRT2 = tl.constexpr(1.4142135623730951)


@triton.jit
def _f64(c):
    """A Python float as a float64 scalar, all 53 bits of it (not rounded through fp32)."""
    return tl.full([], c, tl.float64)


@triton.jit
def _min_p_key(m, min_p):
    """The order key of min-p's threshold T = fl32(m + L), L = fl32(ln(min_p)) (``reference.
    min_p_threshold``): min-p keeps the tokens whose key is >= it.  L by ``reference.min_p_log``'s
    float64 steps, one for one (no fused multiply-add: enable_fp_fusion is off; IEEE division),
    so the bits are the reference's on every backend.  m: the position's max scaled logit; min_p
    in (0, 1] (another value gives some key: its row is invalid anyway)."""
    bits = min_p.to(tl.float64).to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1023
    f = ((bits & 0xFFFFFFFFFFFFF) | (1023 << 52)).to(tl.float64, bitcast=True)
    big = f > _f64(_SQRT2)
    f = tl.where(big, f * _f64(0.5), f)
    e = tl.where(big, e + 1, e).to(tl.float64)
    z = (f - _f64(1.0)) / (f + _f64(1.0))  # float64 `/` is IEEE (div.rn.f64 on a GPU)
    w = z * z
    acc = _f64(_LC11)
    acc = acc * w + _f64(_LC10)
    acc = acc * w + _f64(_LC9)
    acc = acc * w + _f64(_LC8)
    acc = acc * w + _f64(_LC7)
    acc = acc * w + _f64(_LC6)
    acc = acc * w + _f64(_LC5)
    acc = acc * w + _f64(_LC4)
    acc = acc * w + _f64(_LC3)
    acc = acc * w + _f64(_LC2)
    acc = acc * w + _f64(_LC1)
    acc = acc * w + _f64(_LC0)
    L = (e * _f64(_LN2) + z * acc).to(tl.float32)
    return _order_key(m + L).to(tl.int64)


@triton.jit
def _row_offsets(b, cu_ptr, cu_stride, stride_lb, stride_lk, stride_tb, stride_tk, stride_qb, stride_qk,
                 PACKED: tl.constexpr):
    """Element offsets of row b's first position in the logits, its first draft token and its
    first draft distribution.  Padded: row b at b * stride.  PACKED: the rows back to back, row b's
    K_b + 1 positions from logits row cu[b] + b, its drafts from cu[b]."""
    if PACKED:
        c0 = tl.load(cu_ptr + b * cu_stride).to(tl.int64)
        l_off = (c0 + b) * stride_lk
        t_off = c0 * stride_tk
        q_off = c0 * stride_qk
    else:
        l_off = b * stride_lb
        t_off = b * stride_tb
        q_off = b * stride_qb
    return l_off, t_off, q_off


@triton.jit
def _scores(ptr, offs, n, inv_t, PROBS: tl.constexpr):
    """A chunk's scores as fp32: the logits times 1 / T, -inf at offs >= n; or, PROBS, the
    probabilities as given, 0 at offs >= n."""
    if PROBS:
        s = tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    else:
        s = tl.load(ptr + offs, mask=offs < n, other=float("-inf")).to(tl.float32) * inv_t
    return s


@triton.jit
def _weight(s, m, PROBS: tl.constexpr):
    """The unnormalised target weight of a score: exp(s - m) for logits, s itself for PROBS."""
    if PROBS:
        w = s
    else:
        w = tl.exp(s - m)
    return w


@triton.jit
def _logprob(s, m, S, kept, PROBS: tl.constexpr):
    """log p(v) = (s - m) - log S (PROBS: log s - log S), -inf where the warp drops v."""
    if PROBS:
        pos = s > 0.0
        lp = tl.where(pos, tl.log(tl.where(pos, s, 1.0)) - tl.log(S), float("-inf"))
    else:
        lp = (s - m) - tl.log(S)
    return tl.where(kept, lp, float("-inf"))


@triton.jit
def _radix_round(digit, in_set, n_in, n_out, need, LAST: tl.constexpr):
    """One round of radix select on 8-bit digits (0..255, in key order) of the n_in keys in_set
    (n_out elements of the block are not): the digit d of the bucket holding the need-th largest
    key of the set, and (unless LAST) the number of keys of the set in higher buckets and in
    bucket d (one packed sum)."""
    bins = tl.arange(0, 256)
    # tl.histogram counts every element: the ones outside the set go to bin 0 and come off it
    hist = tl.histogram(tl.where(in_set, digit, 0), 256) - tl.where(bins == 0, n_out, 0)
    suffix = n_in - tl.cumsum(hist, axis=0) + hist  # keys of the set with a digit >= d
    d = tl.max(tl.where(suffix >= need, bins, -1), axis=0)
    above = n_in * 0
    n_d = n_in * 0
    if not LAST:
        h64 = hist.to(tl.int64)
        packed = tl.sum(tl.where(bins > d, h64, tl.where(bins == d, h64 << 32, 0)), axis=0)
        above = (packed & 0xFFFFFFFF).to(tl.int32)
        n_d = (packed >> 32).to(tl.int32)
    return d, above, n_d


@triton.jit
def _radix_select(keys, valid, k, n_valid, ROUNDS: tl.constexpr):
    """Radix select over the int32 keys where valid (n_valid of them, 1 <= k <= n_valid), on
    8-bit digits from the top, ROUNDS (1-4) histograms: returns hi, the largest key of the
    bucket (the keys sharing the chosen top 8 * ROUNDS bits) that holds the k-th largest key.
    Fewer than k valid keys are above hi; with ROUNDS = 4, hi is the k-th largest key."""
    n = keys.shape[0]
    need = k
    in_set = valid
    n_in = n_valid
    prefix = tl.full([], 0, tl.int64)
    for r in tl.static_range(ROUNDS):
        if r == 0:
            digit = (keys >> 24) + 128  # the signed top byte, as 0..255 in key order
        else:
            digit = (keys >> (24 - 8 * r)) & 255
        d, above, n_d = _radix_round(digit, in_set, n_in, n - n_in, need, r == ROUNDS - 1)
        need = need - above
        n_in = n_d
        in_set = in_set & (digit == d)
        if r == 0:
            prefix = (d - 128).to(tl.int64)
        else:
            prefix = prefix * 256 + d
    return prefix * (1 << (32 - 8 * ROUNDS)) + ((1 << (32 - 8 * ROUNDS)) - 1)


@triton.jit
def _chunk_candidates(keys, offs, n_valid, cand_ptr, CAP: tl.constexpr):
    """Store the largest keys of one chunk of n_valid tokens at cand_ptr[0:CAP]: all of them when
    n_valid <= CAP, else every key above t_c, the top of the 16-bit bucket (sign, exponent and 7
    mantissa bits) holding the chunk's CAP-th largest key (fewer than CAP keys). Returns (t_c,
    count): every key of the chunk above t_c is in the list (t_c = INT32_MIN: the whole chunk)."""
    if n_valid <= CAP:
        tl.store(cand_ptr + offs, keys.to(tl.int32), mask=offs < n_valid)
        t_c = tl.full([], _INT32_MIN, tl.int64)
        count = n_valid
    else:
        t_c = _radix_select(keys, offs < n_valid, CAP, n_valid, 2)
        gt = keys > t_c
        slot = tl.cumsum(gt.to(tl.int32), axis=0) - 1
        count = tl.max(tl.where(gt, slot + 1, 0), axis=0)
        tl.store(cand_ptr + slot, keys.to(tl.int32), mask=gt)
    return t_c, count


@triton.jit
def _warp_from_candidates(cand, t_sat, m, S, key_max, top_k, top_p, k_on, p_on, scratch_ptr,
                          CAP: tl.constexpr):
    """(thr, S_kept, exact) of a position from its candidate keys cand [NCB * CAP] int32 (-2^31:
    no key; every key of the position above t_sat is among them; see the header): thr the
    smallest kept key, S_kept the kept mass sum exp(s - m); exact is false when the candidates
    cannot decide (the caller then scans the whole position).  scratch_ptr: CAP int32 of room."""
    valid = cand > _INT32_MIN
    e = tl.where(valid, tl.exp(_key_value(cand) - m), 0.0)
    c32 = cand
    cand = cand.to(tl.int64)
    thr = tl.full([], _INT32_MIN, tl.int64)
    S_kept = S
    exact = tl.full([], 1, tl.int1)
    complete = tl.full([], 0, tl.int1)  # the kept set so far lies wholly in the lists
    n_kept = tl.full([], 0, tl.int32)
    if k_on:
        n_cand = tl.sum(valid.to(tl.int32), axis=0)
        if top_k <= n_cand:
            T = _radix_select(c32, valid, top_k.to(tl.int32), n_cand, 4)  # the k-th largest candidate
            if T > t_sat:  # then it is the k-th largest key of the position
                thr = T
                kept = cand >= thr
                n_kept = tl.sum(kept.to(tl.int32), axis=0)
                S_kept = tl.sum(tl.where(kept, e, 0.0), axis=0)
                complete = tl.full([], 1, tl.int1)
            else:
                exact = tl.full([], 0, tl.int1)
        else:
            exact = tl.full([], 0, tl.int1)
    if p_on & exact:
        limit = top_p * S_kept
        if complete & (n_kept <= CAP):
            # The top-k set in one block of CAP (through memory: a register block cannot be
            # compacted): each kept key's strictly-greater mass at once, no bisection.
            kept = cand >= thr
            slot = tl.cumsum(kept.to(tl.int32), axis=0) - 1
            tl.store(scratch_ptr + slot, c32, mask=kept)
            tl.debug_barrier()
            sl = tl.arange(0, CAP)
            kk = tl.load(scratch_ptr + sl, mask=sl < n_kept, other=_INT32_MIN, cache_modifier=".cg").to(tl.int64)
            ek = tl.where(sl < n_kept, tl.exp(_key_value(kk.to(tl.int32)) - m), 0.0)
            above = tl.sum(tl.where(kk[None, :] > kk[:, None], ek[None, :], 0.0), axis=1)  # [CAP]
            cut = tl.min(tl.where((sl < n_kept) & (above < limit), kk, _INT32_MAX), axis=0)
            thr = cut
            S_kept = tl.sum(tl.where(kk >= cut, ek, 0.0), axis=0)
        else:
            lo = tl.maximum(thr, t_sat)  # an answer at or below t_sat is not decided here
            hi = key_max
            while lo < hi:
                mid = lo + (hi - lo) // 2
                above = tl.sum(tl.where(cand >= mid + 1, e, 0.0), axis=0)
                small = above < limit
                hi = tl.where(small, mid, hi)
                lo = tl.where(small, lo, mid + 1)
            if complete | (lo > t_sat):
                thr = lo
                S_kept = tl.sum(tl.where(cand >= thr, e, 0.0), axis=0)
            else:
                exact = tl.full([], 0, tl.int1)
    return thr, S_kept, exact


@triton.jit
def _draft_q(ld, m_d, S_d):
    """q(v) = exp(l_v / T - m_d) / S_d of scaled draft logits ld = l * (1 / T) (DRAFT_LOGITS), with
    the position's max m_d and sum S_d = sum_v exp(ld_v - m_d): the reference's e / sum(e), the
    division IEEE-rounded (``/`` may be 2 ulp off on a GPU)."""
    return tl.math.div_rn(tl.exp(ld - m_d), tl.zeros_like(ld) + S_d)


@triton.jit
def _chunk_weights(pos_ptr, q_ptr, offs, V, q_len, x_j, inv_t, m, S, thr, subtract_q, m_d, S_d, scale,
                   HAS_DRAFT_PROBS: tl.constexpr, PROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One chunk's final-draw weights (fp32): r = max(0, p - q) when subtract_q (the residual
    after a rejection), else r = p; with the non-finite/negative q count.  BLOCK (block
    verification): r = max(0, scale * p - q) in float64, scale the float64 p_i of the position
    (``reference.block_verify_reference``), else r = p in float64.  q (fp32, bf16 or fp16,
    read as fp32) is read up to q_len (0 = not at all), or is one-hot at x_j for a deterministic
    drafter; DRAFT_LOGITS: q_ptr holds the draft's logits, q = exp(l / T - m_d) / S_d (m_d, S_d:
    the position's draft max and sum, from its stage-1 records)."""
    mask = offs < V
    s = _scores(pos_ptr, offs, V, inv_t, PROBS)
    p = tl.where(mask & (_order_key(s).to(tl.int64) >= thr), _weight(s, m, PROBS) / S, 0.0)
    if HAS_DRAFT_PROBS:
        if DRAFT_LOGITS:
            ld = tl.load(q_ptr + offs, mask=offs < q_len, other=float("-inf")).to(tl.float32) * inv_t
            q = tl.where(offs < q_len, _draft_q(ld, m_d, S_d), 0.0)
        else:
            q = tl.load(q_ptr + offs, mask=offs < q_len, other=0.0).to(tl.float32)
    else:
        q = tl.where(offs == x_j, 1.0, 0.0)
    if BLOCK:
        p64 = p.to(tl.float64)
        r = tl.where(subtract_q, tl.maximum(scale * p64 - q.to(tl.float64), 0.0), p64)
    else:
        r = tl.where(subtract_q, tl.maximum(p - q, 0.0), p)
    r = tl.where(r == r, r, 0.0)
    n_bad_q = tl.sum(((q != q) | (q < 0.0) | (q == float("inf"))).to(tl.int32), axis=0)
    return r, mask, n_bad_q


@triton.jit
def _draft_uniforms(b, ks, dmask, uniforms_ptr, stride_ub, stride_uk, flags, seed_ptr, seed_stride, seed_scalar,
                    seed_row_step, off_ptr, off_stride, off_scalar, HAS_UNIFORMS: tl.constexpr):
    """Row b's acceptance-test uniforms [BLOCK_K] (float64) of drafts ks: uniforms[b, ks], or
    24-bit ``tl.rand`` at Philox counter ks + 1 (``reference.philox_uniforms``)."""
    if HAS_UNIFORMS:
        u = tl.load(uniforms_ptr + b * stride_ub + ks * stride_uk, mask=dmask, other=0.0).to(tl.float64)
    else:
        seed, counter_base = _philox_key(b, flags, seed_ptr, seed_stride, seed_scalar, seed_row_step, off_ptr,
                                         off_stride, off_scalar)
        u = tl.rand(seed, counter_base | (ks + 1).to(tl.int64)).to(tl.float64)
    return u


@triton.jit
def _final_uniform(b, uniforms_ptr, stride_ub, stride_uk, K, flags, seed_ptr, seed_stride, seed_scalar, seed_row_step,
                   off_ptr, off_stride, off_scalar, HAS_UNIFORMS: tl.constexpr):
    """Row b's uniform of the final draw (float64): uniforms[b, K], or 53 random bits (27 of
    Philox's first word at counter 0, 26 of its second) on the 2^-53 grid: with fp32's 24, a
    token of probability below ~2^-24 would be drawn with probability 0 or 2^-24, not its own."""
    if HAS_UNIFORMS:
        u_final = tl.load(uniforms_ptr + b * stride_ub + K * stride_uk).to(tl.float64)
    else:
        seed, counter_base = _philox_key(b, flags, seed_ptr, seed_stride, seed_scalar, seed_row_step, off_ptr,
                                         off_stride, off_scalar)
        r0, r1, _, _ = tl.randint4x(seed, counter_base)
        u_final = ((r0 >> 5).to(tl.float64) * 67108864.0 + (r1 >> 6).to(tl.float64)) * 1.1102230246251565e-16
    return u_final


@triton.jit
def _p_masses(pos_ptr, q_ptr, V, NC, inv_t, m_j, S_j, thr_j, m_dj, S_dj, cs_ids, offs0, NCB: tl.constexpr,
              HAS_DRAFT_PROBS: tl.constexpr, PROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr, BLOCK: tl.constexpr,
              CHUNK: tl.constexpr):
    """The float64 chunk masses [NCB] of p itself at one position: the final draw's weights when
    the residual sums to zero (q >= p everywhere in floating point; rare: one pass of its own)."""
    W = tl.zeros([NCB], dtype=tl.float64)
    for cc in range(0, NC):
        r, _, _ = _chunk_weights(pos_ptr, q_ptr, cc * CHUNK + offs0, V, 0, -1, inv_t, m_j, S_j, thr_j, False,
                                 m_dj, S_dj, 1.0, HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS, BLOCK)
        W = tl.where(cs_ids == cc, tl.sum(r.to(tl.float64), axis=0), W)
    return W


@triton.jit
def _draw(W, u_final, cmask, cs_ids, offs0, pos_ptr, q_ptr, V, q_len, x_j, inv_t, m_j, S_j, thr_j, subtract_q,
          m_dj, S_dj, scale, HAS_DRAFT_PROBS: tl.constexpr, PROBS: tl.constexpr, DRAFT_LOGITS: tl.constexpr,
          BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """The inverse-CDF draw from one position's weights, given their float64 chunk masses W [NCB]
    (chunk order): the chunk holding u_final * sum(W) is the first chunk of positive mass whose
    cumulative mass passes it (the last one if rounding leaves none); that chunk's weights are
    recomputed (L2-hot) and summed on in float64 (tiny weights keep their intervals; a token of
    weight 0 is never the hit, whatever order tl.cumsum adds in).  Returns the token (-1 if the
    weights are all zero)."""
    target = u_final * tl.sum(W, axis=0)
    cdf = tl.cumsum(W, axis=0)
    c_hit = tl.min(tl.where(cmask & (W > 0.0) & (cdf > target), cs_ids, _INT32_MAX), axis=0)
    c_last = tl.max(tl.where(cmask & (W > 0.0), cs_ids, -1), axis=0)
    c_star = tl.where(c_hit < _INT32_MAX, c_hit, c_last)
    carry = tl.sum(tl.where(cs_ids == c_star, cdf - W, 0.0), axis=0)
    offs = tl.maximum(c_star, 0) * CHUNK + offs0
    r, mask, _ = _chunk_weights(pos_ptr, q_ptr, offs, V, q_len, x_j, inv_t, m_j, S_j, thr_j, subtract_q, m_dj, S_dj,
                                scale, HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS, BLOCK)
    cdf_v = carry + tl.cumsum(r.to(tl.float64), axis=0)
    hit = tl.min(tl.where(mask & (r > 0.0) & (cdf_v > target), offs, _INT32_MAX), axis=0)
    last_nz = tl.max(tl.where(mask & (r > 0.0), offs, -1), axis=0)
    final = tl.where(hit < _INT32_MAX, hit, last_nz).to(tl.int64)
    return tl.where(c_star < 0, -1, final)


@triton.jit
def _emit(tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, row_tokens_ptr, stride_tk, b, K, j,
          final, bad, BLOCK_K: tl.constexpr):
    """Row b's outputs (stored as the outputs' dtype, int32 or int64): the accepted drafts, the
    final token at j, then -1 (all -1 if bad).  row_tokens_ptr: the row's first draft token."""
    cols = tl.arange(0, BLOCK_K)
    x_all = tl.load(row_tokens_ptr + cols * stride_tk, mask=cols < j, other=-1).to(tl.int64)
    out = tl.where(cols < j, x_all, -1)
    out = tl.where(cols == j, final, out)
    out = tl.where(bad, -1, out)
    tl.store(tokens_ptr + b * stride_ob + cols * stride_oc, out, mask=cols < K + 1)
    tl.store(num_accepted_ptr + b * stride_on, tl.where(bad, -1, j))


@triton.jit
def _verify_split_kernel(
    logits_ptr, stride_lb, stride_lk,  # [B, K+1, V] (PACKED: [sum_b (K_b + 1), V]) fp32/bf16/fp16, last dim contiguous
    draft_tokens_ptr, stride_tb, stride_tk,  # [B, K] (PACKED: [sum_b K_b]) int32/int64
    draft_probs_ptr, stride_qb, stride_qk,  # [B, K, Vd] (PACKED: [sum_b K_b, Vd]) fp32/bf16/fp16, last dim contiguous
    #                                        (DRAFT_LOGITS: the draft's logits, same layout and dtypes)
    cu_ptr, cu_stride,  # PACKED: [B + 1] int32/int64, cu[b] = K_0 + ... + K_{b-1}
    uniforms_ptr, stride_ub, stride_uk,  # [B, K+1] float64/fp32
    param_flags,  # bit set: that parameter is a [B] tensor (ptr, stride), else the scalar
    nd_ptr, nd_stride, nd_scalar,  # num_draft_tokens: int
    t_ptr, t_stride, t_scalar,  # temperature: float, 0 = greedy
    k_ptr, k_stride, k_scalar,  # top_k: int, 0 = off
    p_ptr, p_stride, p_scalar,  # top_p: float, 1 = off
    mp_ptr, mp_stride, mp_scalar,  # min_p: float, 0 = off
    seed_ptr, seed_stride, seed_scalar,  # seed: int64
    off_ptr, off_stride, off_scalar,  # offset: int64
    seed_row_step,  # row b's seed is seed + b * seed_row_step (1 for seed=None's base seed, else 0)
    tokens_ptr, stride_ob, stride_oc,  # out [B, K+1] int32/int64
    num_accepted_ptr, stride_on,  # out [B] int32/int64
    logprobs_ptr, stride_pb, stride_pc,  # out [B, K+1] fp32 (LOGPROBS)
    counters_ptr,  # int32 [2 + B * (K+1) + 3 * B], zero between launches
    part_f_ptr,  # fp32 [2 * B * (K+1) * NC + 2 * B * (K+1)] (DRAFT_LOGITS: twice that)
    part_i_ptr,  # int32 [4 * B * (K+1) * NC + 4 * B * (K+1) + 4 * B + B * NC] (DRAFT_LOGITS: + B * (K+1) * (NC + 1))
    cand_ptr,  # int32 [B * (K+1) * NC * CAP] (with a warp)
    mass_ptr,  # float64 [B * NC] (BLOCK: [2 * B * (K+1) * NC + B * (K+1)])
    order_ptr,  # int32 [T1 + T2]: the item each ticket stands for (tests only, HAS_ORDER)
    B, K, V, Vd, NC, G,
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,  # a min_p argument (tensor or scalar) was given
    HAS_UNIFORMS: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    PACKED: tl.constexpr,  # the ragged layout: rows back to back, K_b from cu
    PROBS: tl.constexpr,  # the target given as probabilities (no temperature, no warp)
    LOGPROBS: tl.constexpr,  # also write each emitted token's target log-probability
    DRAFT_LOGITS: tl.constexpr,  # draft_probs_ptr holds the draft's logits: q = softmax(logits / T), per row's T
    BLOCK: tl.constexpr,  # block verification (Sun et al. 2025) instead of token by token
    CHUNK: tl.constexpr,
    TILES: tl.constexpr,  # chunks per work item
    STAGES: tl.constexpr,  # software-pipelining depth over an item's chunks
    NCB: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    K1 = K + 1
    N1 = B * K1 * NC  # per-chunk records
    NI = (NC + TILES - 1) // TILES  # work items per position (TILES chunks each)
    T1 = B * K1 * NI  # stage-1 tickets
    T2 = B * NI  # stage-2 tickets
    if BLOCK:
        T2 = B * K1 * NI
    # The workspace's fields (element offsets into its four tensors).
    ticket_ptr = counters_ptr
    exit_ptr = counters_ptr + 1
    pos_cnt_ptr = counters_ptr + 2  # [B * (K+1)]
    row_cnt_ptr = pos_cnt_ptr + B * K1  # [B]
    ready_ptr = row_cnt_ptr + B  # [B]
    s2_cnt_ptr = ready_ptr + B  # [B]
    cm_ptr = part_f_ptr  # [B, K+1, NC] chunk max
    cs_ptr = cm_ptr + N1  # [B, K+1, NC] chunk sum of exp(s - chunk max)
    pm_ptr = cs_ptr + N1  # [B, K+1] position max (0 if unusable)
    pS_ptr = pm_ptr + B * K1  # [B, K+1] position kept mass
    ca_ptr = part_i_ptr  # [B, K+1, NC] chunk first argmax
    cb_ptr = ca_ptr + N1  # [B, K+1, NC] chunk non-finite count
    ct_ptr = cb_ptr + N1  # [B, K+1, NC] chunk t_c (every key above it is in the chunk's list)
    cn_ptr = ct_ptr + N1  # [B, K+1, NC] chunk candidate count
    pa_ptr = cn_ptr + N1  # [B, K+1] position argmax
    pb_ptr = pa_ptr + B * K1  # [B, K+1] position unusable
    pt_ptr = pb_ptr + B * K1  # [B, K+1] position threshold key
    rj_ptr = pt_ptr + B * K1  # [B] stop position j
    rr_ptr = rj_ptr + B  # [B] rejected
    rbad_ptr = rr_ptr + B  # [B] invalid row
    rx_ptr = rbad_ptr + B  # [B] the rejected draft x_j (-1 if none)
    cq_ptr = rx_ptr + B  # [B, NC] chunk count of non-finite/negative q_j entries
    pf_ptr = cq_ptr + B * NC  # [B, K+1] 1 where the warp fell back to scanning the whole position
    # DRAFT_LOGITS only (after the fields above, which keep their offsets):
    dm_ptr = pS_ptr + B * K1  # [B, K+1, NC] chunk max of the draft's scaled logits
    ds_ptr = dm_ptr + N1  # [B, K+1, NC] chunk sum of exp(l / T - chunk max)
    pmd_ptr = ds_ptr + N1  # [B, K+1] position draft max m_d (0 if unusable)
    pSd_ptr = pmd_ptr + B * K1  # [B, K+1] position draft sum S_d
    db_ptr = pf_ptr + B * K1  # [B, K+1, NC] chunk count of NaN/+inf draft logits
    pbd_ptr = db_ptr + N1  # [B, K+1] position draft unusable (q_i not a distribution)
    # BLOCK only, in mass_ptr (float64):
    bm_ptr = mass_ptr  # [B, K+1, NC] chunk mass of max(0, p_i P_i - Q_i) below K_b, of P at K_b
    bq_ptr = bm_ptr + N1  # [B, K+1, NC] chunk count of non-finite/negative q_i entries
    pp_ptr = bq_ptr + N1  # [B, K+1] p_0..p_K of the block rule

    offs0 = tl.arange(0, CHUNK)
    cs_ids = tl.arange(0, NCB)
    ks = tl.arange(0, BLOCK_K)

    t = tl.atomic_add(ticket_ptr, 1)
    while t < T1 + T2:
        item = t
        if HAS_ORDER:
            item = tl.load(order_ptr + t)
        if item < T1:
            # ---------------------------------------------------------- stage 1 (b, i, chunks g)
            b = (item // (K1 * NI)).to(tl.int64)
            i = (item // NI) % K1
            g = item % NI
            kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p = _row_params(
                b, K, V, param_flags, nd_ptr, nd_stride, nd_scalar, t_ptr, t_stride, t_scalar,
                k_ptr, k_stride, k_scalar, p_ptr, p_stride, p_scalar, mp_ptr, mp_stride, mp_scalar, cu_ptr, cu_stride,
                HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, PACKED, PROBS)
            l_off, t_off, q_off = _row_offsets(b, cu_ptr, cu_stride, stride_lb, stride_lk, stride_tb, stride_tk,
                                               stride_qb, stride_qk, PACKED)
            warp_on = k_on | p_on | mp_on
            pid_bi = b * K1 + i
            row_on = (i <= kb) & (bad_param == 0)
            pos_ptr = logits_ptr + l_off + i * stride_lk
            # The item's TILES chunks, the next one's loads issued while this one reduces
            # (software pipelining; one chunk per item by default)
            v_read = tl.where(row_on, V, 0)  # a row or position that needs no read reads nothing
            # DRAFT_LOGITS: a sampled row's draft position i < K_b also reduces the draft's logits
            # l_i / T over the chunk (max, sum of exp, NaN/+inf count); chunks past Vd read nothing
            d_on = row_on & (i < kb) & (greedy == 0)
            vd_read = tl.where(d_on, Vd, 0)
            d_pos_ptr = draft_probs_ptr + q_off + i * stride_qk
            for tt in tl.range(0, TILES, num_stages=STAGES):
                c = g * TILES + tt
                rec = pid_bi * NC + c
                offs = c * CHUNK + offs0
                mask = offs < V  # false past the last chunk
                s = _scores(pos_ptr, offs, v_read, inv_t, PROBS)
                if DRAFT_LOGITS:
                    ld = _scores(d_pos_ptr, offs, vd_read, inv_t, False)  # -inf past Vd
                    if d_on & (c < NC):
                        n_bad_d = tl.sum(((ld != ld) | (ld == float("inf"))).to(tl.int32), axis=0)
                        ld = tl.where(ld != ld, float("-inf"), ld)
                        md_c = tl.max(ld, axis=0)
                        md_ref = tl.where(md_c == float("-inf"), 0.0, md_c)
                        tl.store(dm_ptr + rec, md_c)
                        tl.store(ds_ptr + rec, tl.sum(tl.exp(ld - md_ref), axis=0))
                        tl.store(db_ptr + rec, n_bad_d)
                if row_on & (c < NC):
                    if PROBS:  # a probability must be a finite number >= 0
                        n_bad = tl.sum(((s != s) | (s == float("inf")) | (s < 0.0)).to(tl.int32), axis=0)
                        s = tl.where((s != s) | (s < 0.0), 0.0, s)
                    else:
                        n_bad = tl.sum(((s != s) | (s == float("inf"))).to(tl.int32), axis=0)
                        s = tl.where(s != s, float("-inf"), s)
                    m_c = tl.max(s, axis=0)
                    a_c = tl.min(tl.where(s == m_c, offs, _INT32_MAX), axis=0)
                    sum_c = tl.full([], 0.0, tl.float32)
                    if (greedy == 0) | LOGPROBS:  # greedy rows need no exponential (but for log-probabilities)
                        m_ref = tl.where(m_c == float("-inf"), 0.0, m_c)
                        sum_c = tl.sum(_weight(s, m_ref, PROBS), axis=0)
                    tl.store(cm_ptr + rec, m_c)
                    tl.store(cs_ptr + rec, sum_c)
                    tl.store(ca_ptr + rec, a_c)
                    tl.store(cb_ptr + rec, n_bad)
                    if HAS_TOP_K | HAS_TOP_P | HAS_MIN_P:
                        if warp_on:
                            keys = tl.where(mask, _order_key(s), _INT32_MIN)
                            t_c, n_c = _chunk_candidates(keys, offs0, tl.minimum(V - c * CHUNK, CHUNK),
                                                         cand_ptr + rec * CAP, CAP)
                            tl.store(ct_ptr + rec, t_c.to(tl.int32))
                            tl.store(cn_ptr + rec, n_c)
            # Arrive at the position: the last of its NI items combines its NC chunks.
            tl.debug_barrier()
            arrived = tl.atomic_add(pos_cnt_ptr + pid_bi, 1, sem="acq_rel")
            if arrived == NI - 1:
                tl.atomic_xchg(pos_cnt_ptr + pid_bi, 0)
                if (i <= kb) & (bad_param == 0):
                    cmask = cs_ids < NC
                    base = pid_bi * NC
                    m_cs = tl.load(cm_ptr + base + cs_ids, mask=cmask, other=float("-inf"), cache_modifier=".cg")
                    a_cs = tl.load(ca_ptr + base + cs_ids, mask=cmask, other=_INT32_MAX, cache_modifier=".cg")
                    b_cs = tl.load(cb_ptr + base + cs_ids, mask=cmask, other=0, cache_modifier=".cg")
                    m = tl.max(m_cs, axis=0)
                    amax = tl.min(tl.where(m_cs == m, a_cs, _INT32_MAX), axis=0)
                    bad = (tl.sum(b_cs, axis=0) > 0) | (m == float("-inf")) | (m == float("inf"))
                    if PROBS:
                        bad = bad | (m <= 0.0)  # no mass at all
                    m_safe = tl.where(bad, 0.0, m)
                    S = tl.full([], 1.0, tl.float32)
                    thr = tl.full([], _INT32_MIN, tl.int64)
                    scanned = tl.full([], 0, tl.int32)
                    if ((greedy == 0) | LOGPROBS) & (bad == 0):
                        s_cs = tl.load(cs_ptr + base + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
                        if PROBS:
                            S = tl.sum(tl.where(cmask, s_cs, 0.0), axis=0)
                        else:
                            S = tl.sum(tl.where(cmask, s_cs * tl.exp(m_cs - m_safe), 0.0), axis=0)
                        if HAS_TOP_K | HAS_TOP_P | HAS_MIN_P:
                            if warp_on:
                                # slot s of chunk s // CAP holds a key if s % CAP < that chunk's count
                                cids = tl.arange(0, NCB * CAP)
                                c_n = tl.load(cn_ptr + base + cids // CAP, mask=(cids // CAP) < NC, other=0,
                                              cache_modifier=".cg")
                                cand = tl.load(cand_ptr + base * CAP + cids, mask=(cids % CAP) < c_n,
                                               other=_INT32_MIN, cache_modifier=".cg")
                                t_cs = tl.load(ct_ptr + base + cs_ids, mask=cmask, other=_INT32_MIN,
                                               cache_modifier=".cg").to(tl.int64)
                                t_sat = tl.max(t_cs, axis=0)
                                key_max = _order_key(m_safe).to(tl.int64)
                                # room for the top-k set: the position's first chunk list, read above
                                thr, S_w, exact = _warp_from_candidates(cand, t_sat, m_safe, S, key_max,
                                                                        top_k, top_p, k_on, p_on,
                                                                        cand_ptr + base * CAP, CAP)
                                if exact:
                                    S = S_w
                                else:  # the lists cannot decide: bisect over the whole position
                                    scanned = tl.full([], 1, tl.int32)
                                    S, thr = _warp_full(logits_ptr + l_off + i * stride_lk, V, inv_t,
                                                        m_safe, S, key_max, top_k, top_p, k_on, p_on,
                                                        HAS_TOP_K, HAS_TOP_P, CHUNK)
                                if HAS_MIN_P:
                                    # min-p after top-k/top-p: a threshold key from m alone, the
                                    # higher of the two kept (an intersection of upper sets)
                                    thr_mp = _min_p_key(m_safe, min_p)
                                    if mp_on & (thr_mp > thr):
                                        thr = thr_mp
                                        if thr > t_sat:  # every kept token is a candidate: no read
                                            e_c = tl.exp(_key_value(cand) - m_safe)
                                            S = tl.sum(tl.where(cand.to(tl.int64) >= thr, e_c, 0.0), axis=0)
                                        else:  # kept tokens below the lists: one pass for the mass
                                            scanned = tl.full([], 1, tl.int32)
                                            S = _masked_mass(logits_ptr + l_off + i * stride_lk, V, inv_t,
                                                             m_safe, thr, CHUNK)
                    if DRAFT_LOGITS:
                        # the draft's (m_d, S_d) of position i, its chunks in chunk order; defaults
                        # where q_i is not read (greedy rows, the bonus position)
                        m_d = tl.full([], 0.0, tl.float32)
                        S_d = tl.full([], 1.0, tl.float32)
                        bad_d = tl.full([], 0, tl.int1)
                        if (i < kb) & (greedy == 0):
                            md_cs = tl.load(dm_ptr + base + cs_ids, mask=cmask, other=float("-inf"),
                                            cache_modifier=".cg")
                            db_cs = tl.load(db_ptr + base + cs_ids, mask=cmask, other=0, cache_modifier=".cg")
                            sd_cs = tl.load(ds_ptr + base + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
                            md = tl.max(md_cs, axis=0)
                            # a NaN or +inf logit, or none finite: q_i is no distribution
                            bad_d = (tl.sum(db_cs, axis=0) > 0) | (md == float("-inf")) | (md == float("inf"))
                            m_d = tl.where(bad_d, 0.0, md)
                            S_d = tl.sum(tl.where(cmask, sd_cs * tl.exp(md_cs - m_d), 0.0), axis=0)
                            S_d = tl.where(bad_d, 1.0, S_d)
                        tl.store(pmd_ptr + pid_bi, m_d)
                        tl.store(pSd_ptr + pid_bi, S_d)
                        tl.store(pbd_ptr + pid_bi, bad_d.to(tl.int32))
                    tl.store(pm_ptr + pid_bi, m_safe)
                    tl.store(pS_ptr + pid_bi, S)
                    tl.store(pa_ptr + pid_bi, amax)
                    tl.store(pb_ptr + pid_bi, bad.to(tl.int32))
                    tl.store(pt_ptr + pid_bi, thr.to(tl.int32))
                    tl.store(pf_ptr + pid_bi, scanned)
                # Arrive at the row: the last of its K + 1 positions runs the acceptance chain.
                tl.debug_barrier()
                rows_done = tl.atomic_add(row_cnt_ptr + b, 1, sem="acq_rel")
                if rows_done == K1 - 1:
                    tl.atomic_xchg(row_cnt_ptr + b, 0)
                    j = kb * 0
                    rejected = tl.full([], 0, tl.int1)
                    bad_row = bad_param
                    x_j = tl.full([], -1, tl.int64)
                    final = tl.full([], 0, tl.int64)
                    if bad_param == 0:
                        pmask = ks <= kb
                        dmask = ks < kb
                        m_i = tl.load(pm_ptr + b * K1 + ks, mask=pmask, other=0.0, cache_modifier=".cg")
                        S_i = tl.load(pS_ptr + b * K1 + ks, mask=pmask, other=1.0, cache_modifier=".cg")
                        a_i = tl.load(pa_ptr + b * K1 + ks, mask=pmask, other=0, cache_modifier=".cg").to(tl.int64)
                        bad_i = tl.load(pb_ptr + b * K1 + ks, mask=pmask, other=0, cache_modifier=".cg") != 0
                        thr_i = tl.load(pt_ptr + b * K1 + ks, mask=pmask, other=_INT32_MIN,
                                        cache_modifier=".cg").to(tl.int64)
                        x = tl.load(draft_tokens_ptr + t_off + ks * stride_tk, mask=dmask, other=0).to(tl.int64)
                        x_ok = (x >= 0) & (x < V)
                        x_safe = tl.where(x_ok, x, 0)
                        s_x = tl.load(logits_ptr + l_off + ks * stride_lk + x_safe, mask=dmask,
                                      other=0.0).to(tl.float32) * inv_t
                        kept_x = _order_key(s_x).to(tl.int64) >= thr_i
                        p_x = tl.where(kept_x, _weight(s_x, m_i, PROBS) / S_i, 0.0)
                        q_x = tl.full([BLOCK_K], 1.0, tl.float32)
                        if HAS_DRAFT_PROBS:
                            q_x = tl.load(draft_probs_ptr + q_off + ks * stride_qk + x_safe,
                                          mask=dmask & (x_safe < Vd), other=0.0).to(tl.float32)
                            if DRAFT_LOGITS:
                                # q_i(x_i) from the draft's logit at x_i; an unusable q_i is NaN (as
                                # the reference's softmax of such a row), 0 past Vd all the same
                                md_i = tl.load(pmd_ptr + b * K1 + ks, mask=dmask, other=0.0, cache_modifier=".cg")
                                Sd_i = tl.load(pSd_ptr + b * K1 + ks, mask=dmask, other=1.0, cache_modifier=".cg")
                                bd_i = tl.load(pbd_ptr + b * K1 + ks, mask=dmask, other=0, cache_modifier=".cg") != 0
                                q_x = tl.where(bd_i, float("nan"), _draft_q(q_x * inv_t, md_i, Sd_i))
                                q_x = tl.where(dmask & (x_safe < Vd), q_x, 0.0)
                        u = _draft_uniforms(b, ks, dmask, uniforms_ptr, stride_ub, stride_uk, param_flags, seed_ptr,
                                            seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar,
                                            HAS_UNIFORMS)
                        bad_q = ((q_x != q_x) | (q_x < 0.0) | (q_x == float("inf"))) & (greedy == 0)
                        bad_x = ~x_ok | bad_q
                        # in float64: u * q(x) of a 24-bit u and an fp32 q is exact
                        accept = tl.where(greedy, x == a_i, u * q_x.to(tl.float64) < p_x.to(tl.float64))
                        stop = (~accept | bad_i | bad_x) & dmask
                        j = tl.min(tl.where(stop, ks, kb), axis=0).to(tl.int64)
                        rejected = j < kb
                        at_j = ks == j
                        bad_row = (tl.sum((at_j & bad_i).to(tl.int32), axis=0) > 0) | (
                            rejected & (tl.sum((at_j & bad_x).to(tl.int32), axis=0) > 0))
                        final = tl.sum(tl.where(at_j, a_i, 0), axis=0)
                        x_j = tl.where(rejected, tl.sum(tl.where(at_j, x, 0), axis=0), -1)
                        block_row = tl.full([], 0, tl.int1)
                        if BLOCK:
                            if greedy == 0:
                                # block verification reads every position 0..K_b and every draft
                                block_row = tl.full([], 1, tl.int1)
                                bad_row = (tl.sum((pmask & bad_i).to(tl.int32), axis=0) > 0) | (
                                    tl.sum((dmask & bad_x).to(tl.int32), axis=0) > 0)
                                # p_0 = 1, p_i = min(1, p_{i-1} P_i(x_i) / Q_i(x_i)) in float64 (p_i = 1
                                # with no division when p_{i-1} P_i(x_i) >= Q_i(x_i) and is > 0)
                                px64 = tl.where(dmask & (p_x == p_x), p_x.to(tl.float64), 0.0)
                                qx64 = tl.where(dmask & (q_x == q_x) & (q_x > 0.0) & (q_x < float("inf")),
                                                q_x.to(tl.float64), 0.0)
                                pp = tl.where(ks == 0, 1.0, 0.0).to(tl.float64)
                                prev = tl.full([], 1.0, tl.float64)
                                for ii in tl.static_range(BLOCK_K - 1):
                                    num = prev * tl.sum(tl.where(ks == ii, px64, 0.0), axis=0)
                                    qi = tl.sum(tl.where(ks == ii, qx64, 0.0), axis=0)
                                    prev = tl.where((num >= qi) & (num > 0.0), 1.0, num / tl.where(qi > 0.0, qi, 1.0))
                                    pp = tl.where(ks == ii + 1, prev, pp)
                                tl.store(pp_ptr + b * K1 + ks, pp, mask=ks < K1)
                        if LOGPROBS:
                            # the accepted drafts' log p_i(x_i); a greedy row's argmax at j: s = m_j
                            lp = tl.where(ks < j, _logprob(s_x, m_i, S_i, kept_x, PROBS), float("-inf"))
                            lp = tl.where(at_j & (greedy != 0), _logprob(m_i, m_i, S_i, at_j, PROBS), lp)
                            lp = tl.where(bad_row != 0, float("-inf"), lp)
                            # a sampled row's position j is written with its final token (stage 2)
                            later = (at_j | block_row) & (greedy == 0) & (bad_row == 0)
                            tl.store(logprobs_ptr + b * stride_pb + ks * stride_pc, lp, mask=(ks < K1) & (later == 0))
                    if LOGPROBS:
                        if bad_param != 0:
                            tl.store(logprobs_ptr + b * stride_pb + ks * stride_pc,
                                     tl.full([BLOCK_K], float("-inf"), tl.float32), mask=ks < K1)
                    if greedy | bad_row:
                        _emit(tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, draft_tokens_ptr + t_off,
                              stride_tk, b, K, j, final, bad_row, BLOCK_K)
                    tl.store(rj_ptr + b, j.to(tl.int32))
                    tl.store(rr_ptr + b, rejected.to(tl.int32))
                    tl.store(rbad_ptr + b, bad_row.to(tl.int32))
                    tl.store(rx_ptr + b, x_j.to(tl.int32))
                    tl.debug_barrier()
                    tl.atomic_xchg(ready_ptr + b, 1, sem="release")
        else:
            # ------------------------------------------- stage 2 (b, chunks g; BLOCK: b, position, chunks g)
            if BLOCK:
                b = ((item - T1) // (K1 * NI)).to(tl.int64)
                pos = ((item - T1) // NI) % K1
            else:
                b = ((item - T1) // NI).to(tl.int64)
            g = (item - T1) % NI
            # Wait for the row's acceptance chain (stage-1 items only: all numbered before this one).
            ready = tl.atomic_add(ready_ptr + b, 0, sem="acquire")
            while ready == 0:
                ready = tl.atomic_add(ready_ptr + b, 0, sem="acquire")
            kb, greedy, bad_param, inv_t, k_on, p_on, top_k, top_p, mp_on, min_p = _row_params(
                b, K, V, param_flags, nd_ptr, nd_stride, nd_scalar, t_ptr, t_stride, t_scalar,
                k_ptr, k_stride, k_scalar, p_ptr, p_stride, p_scalar, mp_ptr, mp_stride, mp_scalar, cu_ptr, cu_stride,
                HAS_TOP_K, HAS_TOP_P, HAS_MIN_P, PACKED, PROBS)
            l_off, t_off, q_off = _row_offsets(b, cu_ptr, cu_stride, stride_lb, stride_lk, stride_tb, stride_tk,
                                               stride_qb, stride_qk, PACKED)
            bad_row = tl.load(rbad_ptr + b, cache_modifier=".cg") != 0
            sampled = (greedy == 0) & (bad_row == 0)
            if BLOCK:
                # position pos's weights: max(0, p_pos * P - Q) (float64) below K_b, P at K_b
                j = pos.to(tl.int64)
                rejected = j < kb
                x_j = tl.load(draft_tokens_ptr + t_off + j * stride_tk, mask=rejected, other=-1).to(tl.int64)
                pp_j = tl.load(pp_ptr + b * K1 + j, cache_modifier=".cg")
                m_rec = bm_ptr + (b * K1 + j) * NC  # this position's chunk masses
                active = sampled & (j <= kb)
            else:
                j = tl.load(rj_ptr + b, cache_modifier=".cg").to(tl.int64)
                rejected = tl.load(rr_ptr + b, cache_modifier=".cg") != 0
                x_j = tl.load(rx_ptr + b, cache_modifier=".cg").to(tl.int64)
                pp_j = tl.full([], 1.0, tl.float64)
                m_rec = mass_ptr + b * NC
                active = sampled
            pos_ptr = logits_ptr + l_off + j * stride_lk
            q_ptr = draft_probs_ptr + q_off + j * stride_qk
            q_len = tl.where(rejected, Vd, 0)  # q_j is read only after a rejection (BLOCK: below K_b)
            m_j = tl.load(pm_ptr + b * K1 + j, cache_modifier=".cg")
            S_j = tl.load(pS_ptr + b * K1 + j, cache_modifier=".cg")
            thr_j = tl.load(pt_ptr + b * K1 + j, cache_modifier=".cg").to(tl.int64)
            m_dj = tl.full([], 0.0, tl.float32)
            S_dj = tl.full([], 1.0, tl.float32)
            if DRAFT_LOGITS:
                m_dj = tl.load(pmd_ptr + b * K1 + j, cache_modifier=".cg")
                S_dj = tl.load(pSd_ptr + b * K1 + j, cache_modifier=".cg")
            if active:
                # no `if` around the loads (the pipeliner leaves loads under one alone): a chunk
                # past the last (c >= NC) is masked off by offs >= V and q_len <= Vd <= V
                for tt in tl.range(0, TILES, num_stages=STAGES):
                    c = g * TILES + tt
                    r, _, n_bad_q = _chunk_weights(pos_ptr, q_ptr, c * CHUNK + offs0, V, q_len, x_j, inv_t, m_j,
                                                   S_j, thr_j, rejected, m_dj, S_dj, pp_j, HAS_DRAFT_PROBS, PROBS,
                                                   DRAFT_LOGITS, BLOCK)
                    tl.store(m_rec + c, tl.sum(r.to(tl.float64), axis=0), mask=c < NC)
                    if BLOCK:
                        tl.store(bq_ptr + (b * K1 + j) * NC + c, n_bad_q.to(tl.float64), mask=c < NC)
                    else:
                        tl.store(cq_ptr + b * NC + c, n_bad_q, mask=c < NC)
            tl.debug_barrier()
            arrived = tl.atomic_add(s2_cnt_ptr + b, 1, sem="acq_rel")
            if arrived == NI * (K1 if BLOCK else 1) - 1:
                tl.atomic_xchg(s2_cnt_ptr + b, 0)
                tl.atomic_xchg(ready_ptr + b, 0)
                if sampled:
                    cmask = cs_ids < NC
                    if BLOCK:
                        # h_i = r_i / (r_i + 1 - p_i) below K_b, h_{K_b} = p_{K_b} (Sun et al.,
                        # Algorithm 2), as a vector over the draft index ks = i - 1, tested with
                        # draft ks's uniform; tau = the largest i whose test passes, 0 if none
                        dmask = ks < kb
                        i1 = ks + 1
                        rm = (i1[:, None] < kb) & (cs_ids[None, :] < NC)
                        rec2 = (b * K1 + i1[:, None]) * NC + cs_ids[None, :]
                        r_i = tl.sum(tl.load(bm_ptr + rec2, mask=rm, other=0.0, cache_modifier=".cg"), axis=1)
                        qm = (ks[:, None] < kb) & (cs_ids[None, :] < NC)
                        qrec = (b * K1 + ks[:, None]) * NC + cs_ids[None, :]
                        n_bad = tl.sum(tl.sum(tl.load(bq_ptr + qrec, mask=qm, other=0.0, cache_modifier=".cg"),
                                              axis=1), axis=0)
                        bad_row = n_bad > 0.0
                        pp_i = tl.load(pp_ptr + b * K1 + i1, mask=i1 <= kb, other=0.0, cache_modifier=".cg")
                        den = r_i + (1.0 - pp_i)
                        h = tl.where(den > 0.0, r_i / tl.where(den > 0.0, den, 1.0), 0.0)
                        h = tl.where(i1 == kb, pp_i, h)
                        u = _draft_uniforms(b, ks, dmask, uniforms_ptr, stride_ub, stride_uk, param_flags, seed_ptr,
                                            seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar,
                                            HAS_UNIFORMS)
                        j = tl.max(tl.where(dmask & (u < h), i1, 0), axis=0).to(tl.int64)
                        rejected = j < kb
                        x_j = tl.load(draft_tokens_ptr + t_off + j * stride_tk, mask=rejected, other=-1).to(tl.int64)
                        pp_j = tl.load(pp_ptr + b * K1 + j, cache_modifier=".cg")
                        W = tl.load(bm_ptr + (b * K1 + j) * NC + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
                        pos_ptr = logits_ptr + l_off + j * stride_lk
                        q_ptr = draft_probs_ptr + q_off + j * stride_qk
                        q_len = tl.where(rejected, Vd, 0)
                        m_j = tl.load(pm_ptr + b * K1 + j, cache_modifier=".cg")
                        S_j = tl.load(pS_ptr + b * K1 + j, cache_modifier=".cg")
                        thr_j = tl.load(pt_ptr + b * K1 + j, cache_modifier=".cg").to(tl.int64)
                        if DRAFT_LOGITS:
                            m_dj = tl.load(pmd_ptr + b * K1 + j, cache_modifier=".cg")
                            S_dj = tl.load(pSd_ptr + b * K1 + j, cache_modifier=".cg")
                    else:
                        W = tl.load(mass_ptr + b * NC + cs_ids, mask=cmask, other=0.0, cache_modifier=".cg")
                        n_bad_q = tl.sum(tl.load(cq_ptr + b * NC + cs_ids, mask=cmask, other=0,
                                                 cache_modifier=".cg"), axis=0)
                        bad_row = n_bad_q > 0
                        if DRAFT_LOGITS:  # an unusable q_j after a rejection (its m_d, S_d are placeholders)
                            bad_row = bad_row | (rejected & (tl.load(pbd_ptr + b * K1 + j, cache_modifier=".cg") != 0))
                    use_p = tl.sum(W, axis=0) <= 0.0
                    if use_p:
                        W = _p_masses(pos_ptr, q_ptr, V, NC, inv_t, m_j, S_j, thr_j, m_dj, S_dj, cs_ids, offs0, NCB,
                                      HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS, BLOCK, CHUNK)
                    u_final = _final_uniform(b, uniforms_ptr, stride_ub, stride_uk, K, param_flags, seed_ptr,
                                             seed_stride, seed_scalar, seed_row_step, off_ptr, off_stride, off_scalar,
                                             HAS_UNIFORMS)
                    final = _draw(W, u_final, cmask, cs_ids, offs0, pos_ptr, q_ptr, V, q_len, x_j, inv_t, m_j, S_j,
                                  thr_j, rejected & ~use_p, m_dj, S_dj, pp_j, HAS_DRAFT_PROBS, PROBS, DRAFT_LOGITS,
                                  BLOCK, CHUNK)
                    bad_row = bad_row | (final < 0)
                    if LOGPROBS:
                        s_f = tl.load(pos_ptr + tl.maximum(final, 0)).to(tl.float32) * inv_t
                        lp_f = _logprob(s_f, m_j, S_j, _order_key(s_f).to(tl.int64) >= thr_j, PROBS)
                        lp = tl.where(ks == j, lp_f, float("-inf"))
                        if BLOCK:  # the accepted drafts' log p_i(x_i), known only now
                            am = ks < j
                            x_a = tl.load(draft_tokens_ptr + t_off + ks * stride_tk, mask=am, other=0).to(tl.int64)
                            s_a = tl.load(logits_ptr + l_off + ks * stride_lk + x_a, mask=am,
                                          other=0.0).to(tl.float32) * inv_t
                            m_a = tl.load(pm_ptr + b * K1 + ks, mask=am, other=0.0, cache_modifier=".cg")
                            S_a = tl.load(pS_ptr + b * K1 + ks, mask=am, other=1.0, cache_modifier=".cg")
                            thr_a = tl.load(pt_ptr + b * K1 + ks, mask=am, other=_INT32_MIN,
                                            cache_modifier=".cg").to(tl.int64)
                            lp = tl.where(am, _logprob(s_a, m_a, S_a, _order_key(s_a).to(tl.int64) >= thr_a, PROBS),
                                          lp)
                            lp = tl.where(bad_row, float("-inf"), lp)
                            tl.store(logprobs_ptr + b * stride_pb + ks * stride_pc, lp, mask=ks < K1)
                        else:
                            # a row found bad here (its q_j) emits nothing: every slot -inf
                            lp = tl.where(bad_row, float("-inf"), lp)
                            tl.store(logprobs_ptr + b * stride_pb + ks * stride_pc, lp,
                                     mask=(ks < K1) & ((ks == j) | ((ks * 0 + bad_row.to(tl.int32)) != 0)))
                    _emit(tokens_ptr, stride_ob, stride_oc, num_accepted_ptr, stride_on, draft_tokens_ptr + t_off,
                          stride_tk, b, K, j, final, bad_row, BLOCK_K)
        t = tl.atomic_add(ticket_ptr, 1)
    # Leave: the last program to leave resets the ticket for the next launch on this stream.
    left = tl.atomic_add(exit_ptr, 1)
    if left == G - 1:
        tl.atomic_xchg(ticket_ptr, 0)
        tl.atomic_xchg(exit_ptr, 0)
