"""schemathesis against the app's own OpenAPI schema, over real HTTP: no input, valid or not, gets a 5xx, and no
response breaks the schema (status codes, content types, headers, bodies).

Every operation is fuzzed with schema-valid data (the `model` set to the served one, so requests reach the engine)
and with schema-violating data. Generations are clamped small (max_tokens, n, prompt count) to keep the run short;
everything else goes to the server as drawn."""

from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.harness import MODEL, LiveServer, auth, wait_until_idle

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 15}


def _clamp(body: Any, mode: GenerationMode) -> None:
    if not isinstance(body, dict):
        return
    if mode is GenerationMode.POSITIVE and "model" in body:
        body["model"] = MODEL
    for key, cap in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 2), ("best_of", 2), ("min_tokens", 3)):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 3  # chat's default is "the rest of the context": thousands of tokens on CPU
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 2:
        body["prompt"] = prompt[:2]


def test_no_server_errors_and_schema_conformance(server: LiveServer) -> None:
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /health",
        "POST /tokenize",
    }
    for operation in operations:
        for mode, examples in EXAMPLES.items():

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate],
            )  # no shrinking: report the failing case as drawn
            def fuzz(case: Any) -> None:
                _clamp(case.body, mode)  # noqa: B023 - fuzz() runs below, in this iteration
                case.call_and_validate(base_url=server.url, headers=auth(), timeout=30, checks=CHECKS)

            try:
                fuzz()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # a route without inputs has nothing to violate
    m = wait_until_idle(server)
    assert m["llmserve:engine_alive"] == 1 and m["llmserve:kv_blocks_used"] == 0
