"""Property-based fuzzing of the explorer's JSON API from its own OpenAPI schema (/api/openapi.json): hypothesis
draws bodies for every POST route from the schema's request models, in bounds and just outside them (each
field's type, limits, enum; fields dropped, extra, null or of another type), a few hundred in all. Whatever
comes in: no 500, every 4xx carries a message, and the server answers after. 50 bodies per route, 600 in all."""

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hooked_models.explorer import create_app  # noqa: E402

from .conftest import PROMPT  # noqa: E402

WORDS = ["When", " Mary", " John", " to", " the", " store", " Zebra", "..", "/", "layers.0.mlp", "logits", "input",
         "layer_input", "mlp_neurons", "attention_head_outputs", "graph.json", "acts", "../secret.txt", "resid 1",
         "tc[0]", "layer", "seq", "head", "\x00", "é", "<unk>", PROMPT]


@pytest.fixture(scope="module")
def fuzzed(arcee, data_dir, sae, transcoders):
    client = TestClient(create_app(arcee, [data_dir], {"resid 1": sae, "tc": transcoders}), raise_server_exceptions=False)
    schema = client.get("/api/openapi.json").json()
    yield client, schema
    client.app.state.explorer.queue.shutdown()


JUNK = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.lists(st.integers(), max_size=2)


def _value(spec: dict, schemas: dict, valid: bool = True) -> st.SearchStrategy:
    """Values for one property of the schema: inside its bounds and at them (`valid`), or just past them."""
    if "$ref" in spec:
        return _body(schemas[spec["$ref"].rsplit("/", 1)[1]], schemas)
    if "anyOf" in spec:
        return st.one_of([_value(option, schemas, valid) for option in spec["anyOf"]])
    if "enum" in spec:
        return st.sampled_from(spec["enum"]) if valid else st.text(max_size=8)
    kind = spec.get("type")
    if kind == "integer":
        low, high = int(spec.get("minimum", -2**31)), int(spec.get("maximum", 2**31))
        if valid:
            return st.sampled_from([low, high]) | st.integers(low, min(high, low + 64)) | st.integers(low, high)
        return st.integers(low - 3, low - 1) | st.integers(high + 1, high + 3) | st.integers(-2**62, 2**62)
    if kind == "string":
        shortest, longest = spec.get("minLength", 0), spec.get("maxLength", 64)
        if valid:
            return st.sampled_from(WORDS) | st.text(min_size=max(shortest, 1), max_size=12)
        too_long = st.builds(lambda n: "a " * n, st.sampled_from([longest // 2 + 1]))
        return (st.just("") if shortest else st.nothing()) | too_long
    if kind == "array":
        most = spec.get("maxItems", 4)
        items = _value(spec.get("items", {"type": "string"}), schemas)
        return st.lists(items, max_size=most) if valid else st.lists(items, min_size=most + 1, max_size=most + 2)
    if kind == "null":
        return st.none() if valid else JUNK
    return JUNK


def _body(schema: dict, schemas: dict) -> st.SearchStrategy:
    """A JSON object for a request model: a valid one (every required field, some optional ones, each in
    bounds), then as it is or with one field past its bound, of another type, or dropped, or a field added."""
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    valid = st.fixed_dictionaries(
        {name: _value(spec, schemas) for name, spec in properties.items() if name in required},
        optional={name: _value(spec, schemas) for name, spec in properties.items() if name not in required})
    names = st.sampled_from(sorted(properties))

    def mutations(body: dict) -> st.SearchStrategy:
        wrong = names.flatmap(lambda name: (_value(properties[name], schemas, valid=False) | JUNK).map(
            lambda value: {**body, name: value}))
        dropped = names.map(lambda name: {k: v for k, v in body.items() if k != name})
        return st.one_of(st.just(body), wrong, dropped, st.just({**body, "extra": 1}))

    return valid.flatmap(mutations)


# (The subgraph routes see "graph.json", a file without its tensors, never the session's real graph: a fuzzed
# save would write into the file other tests read.)
ROUTES = ["/api/attention", "/api/circuit", "/api/edge", "/api/features/dashboard", "/api/features/search",
          "/api/graph", "/api/patch", "/api/prompt", "/api/subgraph", "/api/subgraph/import",
          "/api/subgraph/interventions", "/api/subgraph/save"]


def test_the_fuzzed_routes_are_every_post_route(fuzzed):
    _, schema = fuzzed
    assert sorted(path for path, item in schema["paths"].items() if "post" in item) == ROUTES


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_no_body_makes_the_server_fail(fuzzed, route, data):
    client, schema = fuzzed
    schemas = schema["components"]["schemas"]
    reference = schema["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = data.draw(_value(reference, schemas), label="body")
    answer = client.post(route, json=body)
    assert answer.status_code < 500, (route, body, answer.text)
    if answer.status_code >= 400:
        message = answer.json().get("error")
        assert isinstance(message, str) and message.strip(), (route, body, answer.text)
    elif "job" in answer.json():  # a job it took: it is cancelled, so the fuzzing does not queue work up
        client.delete(f"/api/jobs/{answer.json()['job']}")
    assert client.get("/api/model").status_code == 200
