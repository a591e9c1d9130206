"""Grammar-constrained decoding through xgrammar: JSON schema, regex or EBNF -> a token mask per step.

GenerateConfig.grammar takes one of
  {"json_schema": schema}   schema as a dict or a JSON string; output is compact JSON (no free whitespace)
  {"regex": pattern}        the whole output matches the pattern
  {"ebnf": text}            xgrammar's EBNF (GBNF-like), start rule `root`
  a dict without those keys: a JSON schema
  a string: EBNF if it contains "::=", a JSON schema if it parses as a JSON object, else a regex

Each lane owns a GrammarState (one xgrammar matcher). Per step: `mask(logits)` sets every token the grammar
cannot take next to -inf, the sampler picks among the rest, `accept(token)` advances the matcher. EOS is the
grammar's stop token: it is allowed exactly when the output so far is a complete sentence of the grammar.
A lane is finished with stop_reason "grammar_complete" when it samples EOS at such a point, or when the
grammar allows nothing but EOS next (`must_end`), so decode never spends a forward on a forced EOS.
"""
from __future__ import annotations

import json
import re
import weakref

import torch
import xgrammar as xgr

from .errors import ConfigError, TinyLoopError

_compilers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tokenizer_info(codec, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of our byte-level BPE vocabulary. Special tokens (EOS) get an empty string so the
    matcher never treats "<|endoftext|>" as text; ids past the tokenizer's vocabulary are never allowed."""
    tok = codec.tokenizer
    vocab = [""] * tok.get_vocab_size()
    for piece, i in tok.get_vocab().items():
        vocab[i] = piece
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special:
            vocab[i] = ""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[codec.eos_id])


def compiler_for(codec, vocab_size: int) -> xgr.GrammarCompiler:
    """One compiler per tokenizer; it caches compiled grammars, so a repeated grammar compiles once."""
    per_codec = _compilers.setdefault(codec, {})
    if vocab_size not in per_codec:
        per_codec[vocab_size] = xgr.GrammarCompiler(tokenizer_info(codec, vocab_size), max_threads=1)
    return per_codec[vocab_size]


def grammar_kind(grammar) -> tuple[str, object]:
    """(kind, source) of a GenerateConfig.grammar value, kind in json_schema | regex | ebnf."""
    if isinstance(grammar, dict):
        keys = [k for k in ("json_schema", "regex", "ebnf") if k in grammar]
        if len(keys) > 1 or (keys and len(grammar) != 1):
            raise ConfigError("GenerateConfig.grammar: a grammar dict holds exactly one of json_schema, regex, ebnf "
                              f"(or is itself a JSON schema), got keys {sorted(grammar)}")
        return (keys[0], grammar[keys[0]]) if keys else ("json_schema", grammar)
    if isinstance(grammar, str):
        if "::=" in grammar:
            return "ebnf", grammar
        try:
            parsed = json.loads(grammar)
        except ValueError:
            parsed = None
        return ("json_schema", parsed) if isinstance(parsed, dict) else ("regex", grammar)
    raise ConfigError(f"GenerateConfig.grammar must be a dict (JSON schema or one of json_schema/regex/ebnf) or a "
                      f"string (regex, EBNF or JSON schema), got {type(grammar).__name__}")


def compile_grammar(codec, vocab_size: int, grammar) -> xgr.CompiledGrammar:
    kind, source = grammar_kind(grammar)
    compiler = compiler_for(codec, vocab_size)
    try:
        if kind == "json_schema":
            schema = source if isinstance(source, str) else json.dumps(source)
            return compiler.compile_grammar(json_schema_ebnf(schema))
        if not isinstance(source, str):
            raise ConfigError(f"GenerateConfig.grammar: {kind} must be a string, got {type(source).__name__}")
        return compiler.compile_regex(source) if kind == "regex" else compiler.compile_grammar(source)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 (xgrammar reports bad input as RuntimeError / ValueError subclasses)
        how = f" ({how_read(grammar)})" if isinstance(grammar, str) and kind == "regex" else ""
        raise ConfigError(f"GenerateConfig.grammar: invalid {kind}: {library_message(exc)}{how}") from None


def how_read(grammar: str) -> str:
    """Why a grammar string was taken for a regex, for its error: a user who meant JSON hears why it is not."""
    note = "a grammar string is EBNF when it contains '::=', a JSON schema when it parses as a JSON object, else a regex"
    if grammar.lstrip().startswith("{"):  # it looks like JSON, so it failed to parse as JSON
        try:
            json.loads(grammar)
        except json.JSONDecodeError as exc:
            return f"{note}; this one is not valid JSON: {exc.msg} at character {exc.pos}"
        except ValueError as exc:  # (not a syntax error: an integer past Python's digit limit)
            return f"{note}; this one is not valid JSON: {exc}"
    return note


def library_message(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[03:52:51] /project/cpp/regex_converter.cc:94: "): the
    user's grammar error only, not the library's source paths."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^(\[[0-9:.]+\]\s*)?(\S+\.(cc|cpp|h|hpp|py):\d+:\s*)+", "", first)[:300]


# xgrammar 0.2.9 lowers a string with minLength/maxLength to a bare class that admits raw control characters
# (upstream issue mlc-ai/xgrammar#800), which strict JSON parsers reject. Close that hole; escapes stay
# unavailable inside length-bounded strings, as upstream has them.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema: str) -> str:
    """The EBNF xgrammar derives from a JSON schema (compact separators), with the bounded-string fix."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


class GrammarState:
    """One lane's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar | None, vocab_size: int, eos_id: int,
                 matcher: xgr.GrammarMatcher | None = None):
        if matcher is None:
            assert compiled is not None  # (a state gets its grammar, or the matcher it continues)
            matcher = xgr.GrammarMatcher(compiled)
        self.matcher = matcher
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._allowed: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model, grammar) -> "GrammarState":
        from .stream_continuation import GrammarPrefix

        if isinstance(grammar, GrammarPrefix):  # a continuation: start after the tokens already delivered
            state = cls.for_model(model, grammar.grammar)
            for token in grammar.tokens:
                state.accept(token)
            return state
        return cls(compile_grammar(model.codec, model.cfg.vocab_size, grammar), model.cfg.vocab_size, model.eos_id)

    def fork(self) -> "GrammarState":
        return GrammarState(None, self.vocab_size, self.eos_id, self.matcher.fork())

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar accepts next (bit i % 32 of word i // 32 of xgrammar's bitmask)."""
        if self._allowed is None:
            self.matcher.fill_next_token_bitmask(self.bitmask)
            bits = (self.bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
            self._allowed = bits.bool().flatten()[:self.vocab_size]
        return self._allowed

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise TinyLoopError(f"grammar matcher rejected token {token} that its own mask allowed")
        self._allowed = None

    def must_end(self) -> bool:
        """The output is complete and the grammar allows nothing but EOS next."""
        allowed = self.allowed()
        return bool(allowed[self.eos_id]) and int(allowed.sum()) == 1
