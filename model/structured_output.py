"""Grammar-constrained decoding through xgrammar: what a constraint is, the compiled-grammar cache, and the checks
that refuse what the backend cannot enforce.

A request's constraint is a `GrammarSpec` (kind + canonical source text). `GrammarCache.compile()` turns it into an
xgrammar `CompiledGrammar` once per distinct spec (LRU); each sequence then gets its own `GrammarMatcher`, which
the model runner asks for a token bitmask before sampling and advances with every sampled token.

xgrammar itself is imported by the first constrained request, not at start: it takes ~0.8 s to import.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("llmserve.structured_output")

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]

# JSON-Schema keywords xgrammar's converter does not enforce (it would drop them and let invalid output through):
# refused up front, by name, rather than silently ignored.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "multipleOf",
        "unevaluatedProperties",
        "unevaluatedItems",
        "propertyNames",
        "patternProperties",
        "$dynamicRef",
        "$dynamicAnchor",
        "$recursiveRef",
    }
)
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema: where the walk descends.
_SCHEMA_VALUED = ("items", "additionalProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


class GrammarError(ValueError):
    """A constraint that cannot be compiled or enforced; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    source: str  # JSON text of a schema, a choice list or a structural tag; a regex; an EBNF grammar

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        return cls("json_schema", canonical_json(schema))


@dataclass(frozen=True, slots=True)
class Constraint:
    """A compiled grammar, ready to make matchers from; travels on SamplingParams."""

    spec: GrammarSpec
    compiled: xgr.CompiledGrammar = field(compare=False, repr=False)


def canonical_json(value: Any) -> str:
    # keys keep their order: xgrammar writes properties in the order the schema lists them
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def check_schema(schema: Any, path: str = "schema") -> None:
    """Raise GrammarError naming the first keyword the backend cannot enforce, or a value that is not a schema."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{path} must be a JSON Schema object, got {type(schema).__name__}")
    for keyword in schema:
        if keyword in UNSUPPORTED_KEYWORDS:
            raise GrammarError(f"JSON Schema keyword {keyword!r} at {path} is not supported for structured output")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise GrammarError(f"only local $ref ('#/...') is supported, got {ref!r} at {path}")
    for keyword in _SCHEMA_VALUED:
        if isinstance(schema.get(keyword), dict):
            check_schema(schema[keyword], f"{path}.{keyword}")
    for keyword in _SCHEMA_LISTS:
        value = schema.get(keyword)
        if value is not None:
            if not isinstance(value, list):
                raise GrammarError(f"{path}.{keyword} must be a list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{path}.{keyword}[{i}]")
    for keyword in _SCHEMA_MAPS:
        value = schema.get(keyword)
        if value is not None:
            if not isinstance(value, dict):
                raise GrammarError(f"{path}.{keyword} must be an object of schemas")
            for name, sub in value.items():
                check_schema(sub, f"{path}.{keyword}.{name}")


def tokenizer_info(hf: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary. Special tokens (chat markers and the like) get an empty string, which
    xgrammar never allows, so no `<|im_start|>` can appear inside a constrained string and then vanish from the
    text when special tokens are skipped; the stop tokens stay allowed where the grammar may end."""
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    vocab = hf.get_vocab()
    encoded: list[bytes | str] = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = token
    special = {t for t in hf.all_special_ids}
    special |= {i for i, added in getattr(hf, "added_tokens_decoder", {}).items() if added.special}
    for token_id in special - set(stop_token_ids):
        if token_id < vocab_size:
            encoded[token_id] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, detected.dump_metadata())


class GrammarCache:
    """Compiled grammars by spec, least recently used evicted first; thread-safe (routes compile off the event
    loop, the engine thread only makes matchers)."""

    def __init__(self, info: xgr.TokenizerInfo, max_entries: int = 256) -> None:
        self.info = info
        # xgrammar's own cache is off: this one is bounded by entries and counts hits and misses.
        import xgrammar as xgr

        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._entries: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self.compile_seconds_total = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, spec: GrammarSpec) -> Constraint | None:
        """The compiled grammar if cached (a hit), else None; never compiles."""
        with self._lock:
            compiled = self._entries.get(spec)
            if compiled is None:
                return None
            self._entries.move_to_end(spec)
            self.hits += 1
            return Constraint(spec, compiled)

    def compile(self, spec: GrammarSpec) -> Constraint:
        cached = self.lookup(spec)
        if cached is not None:
            return cached
        started = time.perf_counter()
        compiled = self._compile(spec)
        seconds = time.perf_counter() - started
        with self._lock:
            self.misses += 1
            self.compile_seconds_total += seconds
            self._entries[spec] = compiled
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        log.debug("compiled a %s grammar in %.1f ms", spec.kind, seconds * 1e3)
        return Constraint(spec, compiled)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            # Compact JSON (no free whitespace): a sampled model could otherwise pad with newlines until
            # max_tokens and never close the object.
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "json_schema":
                check_schema(json.loads(spec.source))
                return self._compiler.compile_json_schema(spec.source, any_whitespace=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            if spec.kind == "choice":  # one of the strings, verbatim (vLLM's guided_choice)
                choices = json.loads(spec.source)
                return self._compiler.compile_grammar("root ::= " + " | ".join(f"({json.dumps(c)})" for c in choices))
            if spec.kind == "grammar":
                return self._compiler.compile_grammar(spec.source)
            return self._compiler.compile_structural_tag(spec.source)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports a bad schema or grammar this way
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {exc}") from exc


def new_matcher(constraint: Constraint) -> xgr.GrammarMatcher:
    import xgrammar as xgr

    return xgr.GrammarMatcher(constraint.compiled)
