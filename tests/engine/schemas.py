"""A hypothesis strategy for JSON Schemas that structured output enforces, bounded (string lengths, integer
ranges, item counts) so that a 135M model sampled hot still closes its objects within a few dozen tokens."""

import json
from typing import Any

from hypothesis import strategies as st

NAMES = st.sampled_from(["id", "name", "city", "tags", "score", "ok", "kind", "note", "value", "items"])

leaf_schemas: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(
        lambda r: {"type": "integer", "minimum": r[0], "maximum": r[0] + r[1]}
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", "a b", "é", 'x"y']), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.sampled_from([r"[a-z]{1,6}", r"[0-9]{2}-[A-Z]", r"(yes|no)"]).map(lambda p: {"type": "string", "pattern": p}),
)


def _containers(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            }
        )
    )
    arrays = st.tuples(children, st.integers(0, 1), st.integers(1, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    unions = st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options})
    return st.one_of(objects, arrays, unions)


schemas: st.SearchStrategy[dict[str, Any]] = _containers(st.recursive(leaf_schemas, _containers, max_leaves=4)).filter(
    lambda schema: len(json.dumps(schema)) < 600
)
