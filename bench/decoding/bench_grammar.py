"""Structured output at speculative speed: JSON-schema generation with ``generate(grammar=...)``
against the target alone under the same grammar and against transformers' ``generate`` with
xgrammar's own logits processor, side by side in one run.

Per (batch, temperature), each side an untimed warm-up then ``--repeats`` timed runs, interleaved
(the median kept): ours (the draft masked by the grammar too), ours with the draft unmasked (its
acceptance without the grammar), the target alone through the same loop and grammar
(``generate_target_only(grammar=)``), and ``target.generate`` with ``xgrammar.contrib.hf.LogitsProcessor``.
Tokens/s counts the emitted tokens (EOS included); the matcher's cost is the time in the grammar's
hooks (``RowGrammars.verify_bitmask``, ``draft_allowed`` and ``allowed_proposals``) per step.
Greedy rows of every side must give the same ids (checked and printed).

Pairs: ``embedded`` (SmolLM2-135M-Instruct and its distilled draft, one tokenizer) and ``real``
(``real_pair.py``: SmolLM2-135M-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct across tokenizers,
the prompts under the target's chat template; prepare it once with ``python
bench/decoding/real_pair.py``).  Across tokenizers the draft masks the shared tokens' logits (the
intersection, sampled rows) or its proposals are cut at the first forbidden token (the string
level, greedy rows); "draft unmasked" turns both off.

    python bench/decoding/bench_grammar.py --threads 2            # the embedded pair, batch 1 and 4
    python bench/decoding/bench_grammar.py --pair real --max-new-tokens 64 --repeats 2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["city", "town", "village"]},
        "location": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                      "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
                     "required": ["lat", "lon"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["port", "capital", "old"]}, "maxItems": 3},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "kind", "location", "tags", "population"],
    "additionalProperties": False,
}
PROMPTS = ["The capital of France, as JSON:", "A small village in Italy, as JSON:", "Describe Tokyo as JSON:",
           "A port town in Norway, as JSON:"]
# the real pair's user messages (under the target's chat template)
REAL_PROMPTS = ["Describe Paris as a JSON object with its name, kind, location (lat, lon), tags and population.",
                "Give a small village in Italy as JSON: name, kind, location, tags and population.",
                "Write Tokyo as a JSON record (name, kind, location with lat and lon, tags, population).",
                "A port town in Norway as a JSON object: name, kind, location, tags, population."]


class HookClock:
    """Seconds spent in the grammar's hooks (the matcher's work), and the number of steps."""

    def __init__(self):
        from specdec_kernels.decoding import grammar as G

        self.G, self.seconds, self.steps = G, 0.0, 0
        self.real_verify, self.real_draft = G.RowGrammars.verify_bitmask, G.RowGrammars.draft_allowed
        self.real_cut = G.RowGrammars.allowed_proposals
        self.timed_draft, self.timed_cut = self._timed(self.real_draft), self._timed(self.real_cut)
        G.RowGrammars.verify_bitmask = self._timed(self.real_verify, step=True)
        G.RowGrammars.draft_allowed, G.RowGrammars.allowed_proposals = self.timed_draft, self.timed_cut

    def _timed(self, fn, step: bool = False):
        """``fn`` with its time added to ``seconds`` (and, ``step``, a step counted)."""
        clock = self

        def timed(self_, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(self_, *a, **k)
            finally:
                clock.seconds += time.perf_counter() - t0
                clock.steps += int(step)

        return timed

    def unmasked_draft(self, on: bool) -> None:
        """The draft proposes without the grammar (the verify still masks: exact, fewer accepted)."""
        self.G.RowGrammars.draft_allowed = (lambda *a, **k: None) if on else self.timed_draft
        self.G.RowGrammars.allowed_proposals = (lambda self_, props, *a, **k: props) if on else self.timed_cut


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-k", "--num-draft-tokens", default="4")
    ap.add_argument("--out", default="bench/results/cpu-xeon/grammar")
    ap.add_argument("--pair", choices=("embedded", "real"), default="embedded")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    from specdec_kernels import SpeculativeDecoder, models
    from specdec_kernels.decoding import grammar as G

    k = args.num_draft_tokens if args.num_draft_tokens == "auto" else int(args.num_draft_tokens)
    if args.pair == "real":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import real_pair

        draft, draft_tok, target, tok = real_pair.load_real_pair()
        dec = SpeculativeDecoder(draft=draft, target=target, tokenizer=tok, draft_tokenizer=draft_tok)
        prompt_texts = [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                                add_generation_prompt=True) for m in REAL_PROMPTS]
        pair_line = ("real pair (SmolLM2-135M-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct across tokenizers, "
                     "vocabulary='auto'), prompts under the target's chat template")
    else:
        draft, target, tok = models.default_pair()
        dec = SpeculativeDecoder(draft, target, tok)
        prompt_texts = PROMPTS
        pair_line = "embedded pair (SmolLM2-135M-Instruct target, its distilled draft)"
    spec = G.json_schema(SCHEMA, any_whitespace=False)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=target.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    clock = HookClock()
    lines = [f"# bench_grammar {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {platform.processor() or platform.machine()}, "
             f"{args.threads} threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}",
             f"# {pair_line}, fp32, K = {k}, "
             f"max_new_tokens {args.max_new_tokens}, {args.repeats} timed runs per side (median), schema: "
             f"bench_grammar.py SCHEMA, JSON on one line",
             "batch,T,side,tokens_per_s,tokens,alpha,matcher_ms_per_step,same_ids_as_target_alone"]
    for B in (int(b) for b in args.batches.split(",")):
        prompts = (prompt_texts * B)[:B]
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        for T in (float(t) for t in args.temperatures.split(",")):
            sample = dict(temperature=T, seed=1) if T > 0 else {}

            def ours(unmasked=False):
                clock.unmasked_draft(unmasked)
                r = dec.generate(prompts, max_new_tokens=args.max_new_tokens, num_draft_tokens=k, grammar=spec,
                                 **sample)
                clock.unmasked_draft(False)
                return r.token_ids, r.stats.acceptance_rate

            def alone():
                r = dec.generate_target_only(prompts, max_new_tokens=args.max_new_tokens, grammar=spec, **sample)
                return r.token_ids, None

            def hf():
                kw = dict(do_sample=True, temperature=T, top_k=0) if T > 0 else dict(do_sample=False)
                with torch.inference_mode():
                    out = target.generate(**enc, max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id,
                                          eos_token_id=tok.eos_token_id,
                                          logits_processor=[LogitsProcessor([compiled] * B)], **kw)
                ids = []
                for row in out[:, enc["input_ids"].shape[1]:].tolist():
                    ids.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
                return ids, None

            sides = {"ours": ours, "ours (draft unmasked)": lambda: ours(True), "target alone (same loop)": alone,
                     "transformers + xgrammar": hf}
            for fn in sides.values():  # untimed warm-up
                fn()
            runs = {name: [] for name in sides}
            for _ in range(args.repeats):
                for name, fn in sides.items():
                    clock.seconds, clock.steps = 0.0, 0
                    t0 = time.perf_counter()
                    ids, alpha = fn()
                    dt = time.perf_counter() - t0
                    n = sum(len(r) for r in ids)
                    runs[name].append((n / dt, n, alpha, 1e3 * clock.seconds / max(clock.steps, 1), ids))
            ref_ids = runs["target alone (same loop)"][0][4]
            for name, rs in runs.items():
                speed = statistics.median(r[0] for r in rs)
                r = sorted(rs, key=lambda r: r[0])[(len(rs) - 1) // 2]
                same = "" if T > 0 else str(r[4] == ref_ids)
                lines.append(f"{B},{T:g},{name},{speed:.2f},{r[1]},{'' if r[2] is None else f'{r[2]:.3f}'},"
                             f"{r[3]:.2f},{same}")
                print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_grammar.csv"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:2]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
