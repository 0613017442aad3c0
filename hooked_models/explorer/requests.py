"""The explorer's request bodies, with every size a request can set bounded, and the bounds themselves.

The bounds come from the model and the machine (`Limits.of`), go into the request models as pydantic
Field constraints (so FastAPI's OpenAPI schema, /api/openapi.json, states them), and are checked before
any work: a request over one is a 422 naming the value and the bound (server.py turns pydantic's
validation error into that message). A field a body does not have is refused the same way, naming it
(a misspelt `"step"` would otherwise be dropped and the request run with the default). Bounds that need
the prompt's tokens (a sweep's size) are checked in server.py with the same words, before the job is queued.
"""

import os
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, create_model

from hooked_models.circuits.eap import MANY_STEPS

MAX_TOP_K = 50  # a list of predictions or features longer than this is not read in a page
# Tokenizing this many characters takes milliseconds; anything longer is cut by the model's positions anyway.
MAX_PROMPT_CHARS = 100_000
# The Riemann sum of EAP-IG's integral converges long before this (its papers use 5 to 100 steps); more
# steps only take longer. The library warns past the same number.
MAX_STEPS = MANY_STEPS
# A patching heatmap of more cells than this is not readable in a page (and every cell is a patched run).
MAX_PATCHES = 2**16
MAX_NAME = 300  # a value, a hook, a node or a token's text; the model's own names are far shorter
MAX_PATH = 4096  # PATH_MAX on Linux
# circuit-tracer's viewer draws at most 200 pinned nodes; a subgraph ten times that is not read in a page.
MAX_NODES = 2000
MAX_SCALES = 16  # interventions run parts x scales cases: a few strengths per part is what a figure shows
MAX_BATCH = 4096


def _memory_bytes() -> int:
    """The machine's physical memory (bytes), or 16 GiB where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


@dataclass(frozen=True)
class Limits:
    """Every bound the explorer puts on a request, for one model on this machine."""

    positions: int  # the model's positions: longer prompts are cut (with a notice)
    top_k: int
    steps: int
    patches: int
    prompt_chars: int
    graph_bytes: int  # a graph file is parsed in memory, some ten times its size

    @classmethod
    def of(cls, model) -> "Limits":
        return cls(positions=model.max_positions, top_k=min(MAX_TOP_K, model.cfg.vocab_size), steps=MAX_STEPS,
                   patches=MAX_PATCHES, prompt_chars=MAX_PROMPT_CHARS,
                   graph_bytes=min(256 * 2**20, _memory_bytes() // 16))

    def as_dict(self) -> dict:
        return dict(vars(self))


# Unknown fields are refused ("extra_forbidden"), not ignored.
STRICT = ConfigDict(extra="forbid")


def request_models(limits: Limits) -> dict[str, type[BaseModel]]:
    """The request bodies for one model's bounds, by name."""
    prompt = Field(min_length=1, max_length=limits.prompt_chars, description="text; cut to the model's positions")
    token = Field(min_length=1, max_length=MAX_NAME, description="one token's text")
    name = Field(min_length=1, max_length=MAX_NAME)
    pair = {"clean": (str, prompt), "corrupted": (str, prompt), "answer": (str, token), "wrong": (str, token)}

    def body(title: str, **fields) -> type[BaseModel]:
        return create_model(title, __config__=STRICT, **fields)

    models = {
        "PromptRequest": body(
            "PromptRequest", prompt=(str, prompt),
            top_k=(int, Field(5, ge=1, le=limits.top_k, description="predictions listed per position")),
            # the token the logit lens follows (default: the prediction at the last position)
            answer=(str | None, Field(None, max_length=MAX_NAME))),
        "PairRequest": body("PairRequest", **pair),
        "PatchRequest": body(
            "PatchRequest", **pair, value=(str, Field("layer_input", min_length=1, max_length=MAX_NAME)),
            over=(list[str] | None, Field(None, max_length=8, description="the value's axes to sweep")),
            direction=(Literal["denoising", "noising"], "denoising")),
        "CircuitRequest": body(
            "CircuitRequest", **pair, method=(Literal["eap-ig", "eap"], "eap-ig"),
            steps=(int, Field(5, ge=1, le=limits.steps, description="EAP-IG's integration steps"))),
        "EdgeRequest": body("EdgeRequest", **pair, writer=(str, name), reader=(str, name)),
        "GraphRequest": body("GraphRequest", path=(str, Field(min_length=1, max_length=MAX_PATH))),
        "FeatureRequest": body(
            "FeatureRequest", harvest=(str, Field(min_length=1, max_length=MAX_PATH)), sae=(str, name),
            feature=(int, Field(ge=0, le=2**31 - 1, description="below the SAE's width"))),
        "SearchRequest": body(
            "SearchRequest", harvest=(str, Field(min_length=1, max_length=MAX_PATH)), sae=(str, name),
            token=(str, token), k=(int, Field(10, ge=1, le=MAX_TOP_K))),
    }
    path = (str, Field(min_length=1, max_length=MAX_PATH, description="a graph file AttributionGraph.to_json wrote"))
    node = Annotated[str, Field(max_length=MAX_NAME)]
    subgraph = {
        "path": path,
        "supernodes": (list[Annotated[list[node], Field(max_length=MAX_NODES + 1)]],
                       Field([], max_length=MAX_NODES, description="[name, *node ids] each, as qParams hold them")),
        "pinned": (list[node], Field([], max_length=MAX_NODES, description="node ids (qParams' pinnedIds)"))}
    # A scale is a finite JSON number (an integer too): strict, so "2" or true is refused, not read as one.
    scale = Annotated[StrictFloat, Field(allow_inf_nan=False)]
    models["SubgraphRequest"] = create_model("SubgraphRequest", **subgraph)
    models["SubgraphImportRequest"] = create_model(
        "SubgraphImportRequest", path=path, source=(str, Field(min_length=1, max_length=MAX_PATH)))
    models["InterventionRequest"] = create_model(
        "InterventionRequest", **subgraph,
        scales=(list[scale], Field([-1.0, 0.0, 2.0], min_length=1, max_length=MAX_SCALES)),
        modes=(list[Literal["frozen", "free"]], Field(["frozen", "free"], min_length=1, max_length=2)),
        parts=(list[node] | None, Field(None, max_length=MAX_NODES, description="the parts intervened on (all)")),
        logit_diff=(list[node] | None, Field(None, min_length=2, max_length=2, description="two tokens' text")),
        batch_size=(int | None, Field(None, ge=1, le=MAX_BATCH)))
    return models


def validation_message(errors: list[dict]) -> str:
    """pydantic's validation errors as one line naming each value and its bound:
    "steps=100000000: Input should be less than or equal to 1000"."""
    parts = []
    for error in errors[:5]:
        where = ".".join(str(part) for part in error["loc"] if part != "body")
        given = error.get("input")
        shown = repr(given) if not isinstance(given, str) or len(given) <= 40 else f"{len(given)} characters"
        # pydantic's "Extra inputs are not permitted" does not say that the name itself is what is wrong
        msg = "not a field of this request" if error["type"] == "extra_forbidden" else error["msg"]
        parts.append(f"{where or 'the body'}={shown}: {msg}" if "input" in error and error["type"] !=
                     "missing" else f"{where}: {msg}")
    return "; ".join(parts)
