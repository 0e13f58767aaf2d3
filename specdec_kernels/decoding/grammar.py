"""Structured output: ``generate(..., grammar=...)``, each row's tokens kept to a grammar, exactly.

The law under a grammar is the target's distribution restricted, at each prefix, to the tokens the
grammar allows there and renormalised: what plain decoding with the same mask gives.  A row keeps
one xgrammar ``GrammarMatcher``.  Before each verify the matcher accepts the row's drafts
speculatively, one at a time, and fills the mask of every position from its own prefix (the drafts
are known before verification), then rolls them back: ``fused_verify(token_bitmask=)`` applies the
K + 1 masks.  A draft the grammar forbids has probability 0 under the masked target, so it is
rejected there and the positions after it are never read.  After the step the matcher takes the
tokens the row emitted.  A draft model and a feature draft draft under the same grammar (their
logits masked at each draft's prefix, ``mask_draft``, so q is the masked draft law and acceptance
stays high), and so does a draft over another tokenizer drafting the shared tokens (the
intersection: the grammar's mask of the shared tokens); prompt lookup and a draft over another
tokenizer at the string level propose only what the grammar allows (their proposals cut before the
first forbidden token, ``allowed_proposals``).  A drafter that proposes without the grammar costs
acceptance, never exactness.  The grammar's stop tokens are the call's EOS ids: EOS is
allowed only where the grammar may end, and a row ends there.

Grammars (xgrammar, an optional dependency: ``pip install specdec-kernels[grammar]``): a JSON
schema (a dict, or a string holding a JSON object), ``json_schema(...)``, ``regex(...)``,
``ebnf(...)`` (xgrammar's EBNF), or an ``xgrammar.CompiledGrammar`` compiled for the target's
tokenizer and vocabulary size; one for every row, or a list with one per row (None: that row is
free).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Optional

import torch

from ..ops.verify.bitmask import allowed_tokens, bitmask_width

__all__ = ["GrammarSpec", "RowGrammars", "ebnf", "json_schema", "regex", "row_grammars"]


class GrammarSpec(NamedTuple):
    """A grammar to compile for the target's tokenizer: kind ``"json_schema"``, ``"regex"`` or
    ``"ebnf"``, its text (a JSON schema may be a dict), and options for xgrammar's compiler as
    (name, value) pairs."""

    kind: str
    source: Any
    options: tuple = ()


def json_schema(schema, *, any_whitespace: bool = True, indent=None, strict_mode: bool = True) -> GrammarSpec:
    """A JSON schema (a dict or its JSON text): the output is JSON that validates against it.
    any_whitespace=False: JSON laid out one way (``indent`` spaces per level, None: one line), so
    that a model cannot fill a row's budget with whitespace; strict_mode=False: properties the schema
    does not name are allowed (xgrammar's ``compile_json_schema`` options)."""
    if not isinstance(schema, (dict, str)):
        raise TypeError(f"json_schema(schema): schema must be a dict or its JSON text, got {type(schema).__name__}")
    if indent is not None and (isinstance(indent, bool) or not isinstance(indent, int) or indent < 0):
        raise ValueError(f"json_schema(indent=): indent must be None or an int >= 0, got {indent!r}")
    return GrammarSpec("json_schema", schema, (("any_whitespace", bool(any_whitespace)), ("indent", indent),
                                               ("strict_mode", bool(strict_mode))))


def regex(pattern: str) -> GrammarSpec:
    """A regular expression the whole output matches."""
    if not isinstance(pattern, str) or not pattern:
        raise TypeError(f"regex(pattern): pattern must be a non-empty str, got {pattern!r:.60}")
    return GrammarSpec("regex", pattern)


def ebnf(grammar: str) -> GrammarSpec:
    """An EBNF grammar in xgrammar's dialect (its root rule ``root``)."""
    if not isinstance(grammar, str) or not grammar:
        raise TypeError(f"ebnf(grammar): grammar must be a non-empty str, got {grammar!r:.60}")
    return GrammarSpec("ebnf", grammar)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - the test environment installs it
        raise ImportError("grammar= needs xgrammar: pip install 'specdec-kernels[grammar]' (or xgrammar)") from e
    return xgrammar


def _spec(g) -> Any:
    """A GrammarSpec, an xgrammar CompiledGrammar or None from what the caller passed."""
    if g is None or isinstance(g, GrammarSpec):
        return g
    if isinstance(g, dict):
        return json_schema(g)
    if isinstance(g, str):
        try:
            parsed = json.loads(g)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError(f"grammar as a string must be a JSON schema (a JSON object); for a regex or an EBNF "
                             f"grammar pass grammar.regex(...) or grammar.ebnf(...), got {g[:60]!r}")
        return json_schema(g)
    if type(g).__name__ == "CompiledGrammar":
        return g
    raise TypeError(f"grammar must be a JSON schema (dict or str), grammar.json_schema/regex/ebnf(...), an "
                    f"xgrammar CompiledGrammar, None, or a list of those (one per row), got {type(g).__name__}")


class _Compiler:
    """xgrammar's compiler for one tokenizer at the target's vocabulary size (kept per decoder)."""

    def __init__(self, tokenizer, vocab_size: int):
        xgr = _xgrammar()
        self.tokenizer = tokenizer  # kept: the cache below is keyed by its id
        if tokenizer is None:
            raise ValueError("grammar= needs the decoder's tokenizer to compile a grammar over text (or pass an "
                             "xgrammar CompiledGrammar), got tokenizer=None")
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)

    def compile(self, spec: GrammarSpec):
        kind, source, options = spec
        if kind == "json_schema":
            xgr = _xgrammar()
            text = str(xgr.Grammar.from_json_schema(source if isinstance(source, str) else json.dumps(source),
                                                    **dict(options)))
            # xgrammar 0.2.9 writes a length-bounded string's characters as [^"\\\r\n], which lets a raw
            # control character (U+0000-U+001F) into a JSON string, and json.loads refuses the text:
            # its unbounded strings' class, which excludes them, is used instead.
            return self.compiler.compile_grammar(text.replace(_LOOSE_CHARS, _JSON_CHARS))
        if kind == "regex":
            return self.compiler.compile_regex(source)
        if kind == "ebnf":
            return self.compiler.compile_grammar(source)
        raise ValueError(f"grammar kind must be 'json_schema', 'regex' or 'ebnf', got {kind!r}")


_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'  # as xgrammar prints the class: [^\"\\\r\n]
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'
_COMPILERS: dict = {}  # (id of the tokenizer, V) -> _Compiler, for the tokenizers still alive


def _compiler(tokenizer, vocab_size: int) -> _Compiler:
    key = (id(tokenizer), vocab_size)
    got = _COMPILERS.get(key)
    if got is None or got.tokenizer is not tokenizer:
        got = _COMPILERS[key] = _Compiler(tokenizer, vocab_size)
    return got


class RowGrammars:
    """One matcher per prompt of a call (None: a free row); the masks of its verify positions and of
    its draft positions, each from its own prefix."""

    def __init__(self, compiled: list, eos: set, vocab_size: int, device: torch.device):
        xgr = _xgrammar()
        if not eos and any(c is not None for c in compiled):
            raise ValueError("grammar= needs an EOS id to end a row where the grammar ends, got eos_token_id=[]")
        stop = sorted(eos)
        self.matchers = [None if c is None else xgr.GrammarMatcher(c, override_stop_tokens=stop) for c in compiled]
        self.consumed = [0] * len(compiled)
        self.vocab_size, self.width, self.device = vocab_size, bitmask_width(vocab_size), device

    def _sync(self, p: int, generated: list) -> Any:
        """Prompt p's matcher after the tokens the row has emitted (None for a free row)."""
        m = self.matchers[p]
        if m is None:
            return None
        for t in generated[self.consumed[p]:]:
            if not m.accept_token(int(t)):  # every emitted token was allowed: this is a bug, not an input
                raise RuntimeError(f"grammar: row {p} emitted token {t}, which its grammar does not allow")
        self.consumed[p] = len(generated)
        return m

    def _fill(self, m, prefix: list, flat: torch.Tensor, first: int, count: int) -> None:
        """Rows first .. first + count - 1 of ``flat`` [N, W]: the masks after prefix[:0], prefix[:1],
        ...; a prefix the grammar refuses, or ends with a stop token, leaves the rest all-allowed
        (never read: the draft that broke it is rejected where it stands, and a row ends at EOS)."""
        m.fill_next_token_bitmask(flat, first)
        taken = 0
        for i in range(1, count):
            if not m.accept_token(int(prefix[i - 1])):
                break
            taken += 1
            if m.is_terminated():  # the draft was a stop token: nothing after it is read
                break
            m.fill_next_token_bitmask(flat, first + i)
        if taken:
            m.rollback(taken)

    def verify_bitmask(self, drafts: list, kb_host: list, rows: list, generated: list, K: int) -> torch.Tensor:
        """[B, K + 1, W] int32 for ``fused_verify(token_bitmask=)``: row b's position i allows what
        its grammar allows after its emitted tokens and drafts x_1 .. x_i."""
        B = len(rows)
        mask = torch.full((B, K + 1, self.width), -1, dtype=torch.int32)
        flat = mask.view(B * (K + 1), self.width)
        for b, p in enumerate(rows):
            m = self._sync(p, generated[p])
            if m is not None:
                self._fill(m, drafts[b], flat, b * (K + 1), kb_host[b] + 1)
        return mask.to(self.device)

    def draft_allowed(self, drafts: list, rows: list, generated: list, vocab: int) -> Optional[torch.Tensor]:
        """[B, vocab] bool: what each row's grammar allows after its emitted tokens and the drafts
        so far (drafts: x_1 .. x_j, each [B]); None when no row has a grammar."""
        if all(self.matchers[p] is None for p in rows):
            return None
        B, j = len(rows), len(drafts)
        host = torch.stack(drafts, 1).tolist() if j else [[] for _ in rows]
        mask = torch.full((B, self.width), -1, dtype=torch.int32)
        for b, p in enumerate(rows):
            m = self._sync(p, generated[p])
            if m is None:
                continue
            ok = 0
            for t in host[b]:
                if m.is_terminated() or not m.accept_token(int(t)):
                    break
                ok += 1
            if ok == j and not m.is_terminated():  # else the row's drafts past here are not read
                m.fill_next_token_bitmask(mask, b)
            if ok:
                m.rollback(ok)
        return allowed_tokens(mask, self.vocab_size)[:, :vocab].to(self.device)

    def mask_draft(self, logits: torch.Tensor, drafts: list, rows: list, generated: list, vocab: int,
                   vocab_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A drafter's logits for its next draft, [B, vocab] (or [B, N] over ``vocab_rows``, a draft
        vocabulary's target ids), -inf where a row's grammar forbids the token after its emitted
        tokens and the drafts so far (``draft_allowed``): the drafter's q is the masked draft law."""
        allowed = self.draft_allowed(drafts, rows, generated, vocab)
        if allowed is None:
            return logits
        if vocab_rows is not None:
            allowed = allowed.index_select(1, vocab_rows)
        return logits.masked_fill(~allowed, float("-inf"))

    def allowed_proposals(self, proposals: list, rows: list, generated: list) -> list:
        """Each row's proposed tokens (lists of ids) cut before the first one its grammar forbids
        after its emitted tokens and the proposals before it (a stop token ends the proposal): a
        deterministic drafter's drafts under the grammar.  A forbidden draft would be rejected
        where it stands, so cutting it changes nothing but the work."""
        out = []
        for b, p in enumerate(rows):
            m = self._sync(p, generated[p])
            prop = proposals[b]
            if m is None:
                out.append(prop)
                continue
            ok = 0
            for t in prop:
                if m.is_terminated() or not m.accept_token(int(t)):
                    break
                ok += 1
            if ok:
                m.rollback(ok)
            out.append(prop[:ok])
        return out


def row_grammars(grammar, tokenizer, vocab_size: int, B: int, eos: set, device: torch.device) -> Optional[RowGrammars]:
    """``generate``'s ``grammar=`` for a call of B rows: None, or the rows' matchers."""
    if grammar is None:
        return None
    per_row = isinstance(grammar, (list, tuple)) and not isinstance(grammar, GrammarSpec)
    specs = [_spec(g) for g in grammar] if per_row else [_spec(grammar)] * B
    if len(specs) != B:
        raise ValueError(f"grammar as a list must hold one grammar per prompt ({B}), got {len(specs)}")
    if all(s is None for s in specs):
        return None
    cache: dict = {}
    compiled = []
    for s in specs:
        if s is not None and not isinstance(s, GrammarSpec):  # an xgrammar CompiledGrammar
            have = s.tokenizer_info.vocab_size
            if have != vocab_size:
                raise ValueError(f"grammar: a CompiledGrammar must be compiled for the target's vocabulary "
                                 f"({vocab_size} tokens), got one for {have}")
            compiled.append(s)
            continue
        key = None if s is None else (s.kind, json.dumps(s.source, sort_keys=True) if isinstance(s.source, dict)
                                      else s.source, s.options)
        if s is not None and key not in cache:
            cache[key] = _compiler(tokenizer, vocab_size).compile(s)
        compiled.append(None if s is None else cache[key])
    return RowGrammars(compiled, eos, vocab_size, device)
