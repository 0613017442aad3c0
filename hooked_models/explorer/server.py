"""The explorer's server: a JSON API over the library's own functions, and the page's static files.

Every number it sends is computed by the package (`run_with_cache`, `cache.logit_lens`,
`patching.activation_patch`, `circuits.edge_attribution` / `edge_patch` / `faithfulness_curve`,
`features.dashboard` / `search_by_token`, a saved `features.statistics` result read feature by feature);
the server only parses requests, runs them and sends the
results as JSON. Long computations (patching, circuits, feature passes over a harvest) are background jobs
(`jobs.py`): a request returns the job's id at once and the page polls `/api/jobs/{id}`.

Safety: files are read only under the directories given (`data`), resolved with symlinks followed, so
`..` or a link out is refused; files are parsed as JSON or safetensors, never unpickled; no request
names code to run (values and edges are looked up in the model's own tables).
"""

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError

from hooked_models import circuits, features, patching
from hooked_models.attribution import AttributionGraph
from hooked_models.attribution.export import json_node
from hooked_models.explorer.graph_file import GraphFile
from hooked_models.explorer.jobs import Job, Jobs, message
from hooked_models.features.results import META as STATISTICS
from hooked_models.transcoders import TranscoderSet
from hooked_models.saes import sae_hook_name

STATIC = Path(__file__).parent / "static"
MAX_GRAPH_BYTES = 256 * 2**20  # a graph file larger than this is refused before it is read
MAX_TOP_K = 50


class RefusedPath(ValueError):
    """A path outside the directories the server was given."""


# ------------------------------------------------------------------------------------------ requests
class PromptRequest(BaseModel):
    prompt: str
    top_k: int = 5
    answer: str | None = None  # the token the logit lens follows (default: the prediction at the last position)


class PairRequest(BaseModel):
    clean: str
    corrupted: str
    answer: str
    wrong: str


class PatchRequest(PairRequest):
    value: str = "layer_input"
    over: list[str] | None = None
    direction: str = "denoising"


class CircuitRequest(PairRequest):
    method: str = "eap-ig"
    steps: int = 5


class EdgeRequest(PairRequest):
    writer: str
    reader: str


class GraphRequest(BaseModel):
    path: str


class FeatureRequest(BaseModel):
    harvest: str
    sae: str
    feature: int


class SearchRequest(BaseModel):
    harvest: str
    sae: str
    token: str
    k: int = 10


def finite_list(tensor: torch.Tensor) -> list:
    """tensor.tolist() with every non-finite entry (a masked score's -inf) as None: JSON has no infinity."""
    values = tensor.tolist()
    if not bool(tensor.isfinite().all()):
        flat = tensor.flatten()
        for index in (~flat.isfinite()).nonzero().flatten().tolist():
            *outer, last = torch.unravel_index(torch.tensor(index), tensor.shape)
            row = values
            for i in outer:
                row = row[int(i)]
            row[int(last)] = None
    return values


# ------------------------------------------------------------------------------------------ explorer
class Explorer:
    """What the app serves: one model, the directories it may read, and the SAEs and transcoders the
    features view offers, by name."""

    def __init__(self, model, data: Sequence[str | Path] = (), saes: Mapping[str, nn.Module] | None = None):
        self.model = model.eval()
        self.roots = [Path(d).resolve() for d in data]
        for root in self.roots:
            if not root.is_dir():
                raise ValueError(f"data directory {root} does not exist or is not a directory")
        self.saes = _per_layer(saes or {})
        self.lock = threading.Lock()
        self.queue = Jobs(self.lock)

    # ---------------------------------------------------------------------------- inputs
    def path(self, path: str) -> Path:
        """`path` (relative to the first data directory, or absolute) if it lies under a data directory."""
        if not self.roots:
            raise RefusedPath("the server was given no data directories (--data DIR) to read files from")
        candidate = Path(path)
        resolved = (candidate if candidate.is_absolute() else self.roots[0] / candidate).resolve()
        if not any(resolved == root or root in resolved.parents for root in self.roots):
            raise RefusedPath(f"{path!r} is outside the data directories the server reads "
                              f"({', '.join(map(str, self.roots))})")
        if not resolved.exists():
            raise ValueError(f"{path!r} does not exist under the data directories")
        return resolved

    def token(self, text: str) -> int:
        """The id of a string that is exactly one known token, else a ValueError naming it."""
        token = self.model.to_single_token(text)
        tokenizer = self.model.tokenizer
        unk = getattr(tokenizer, "unk_token_id", None)
        if unk is not None and token == unk and text.strip() != tokenizer.unk_token:
            raise ValueError(f"{text!r} is not in the vocabulary (it reads as {tokenizer.unk_token})")
        return token

    def tokens(self, text: str) -> torch.Tensor:
        if not text.strip():
            raise ValueError("the prompt is empty")
        return self.model.to_tokens(text)

    def pair(self, request: PairRequest):
        clean, corrupted = self.tokens(request.clean), self.tokens(request.corrupted)
        if clean.shape != corrupted.shape:
            raise ValueError(f"the clean prompt is {clean.shape[1]} tokens and the corrupted one "
                             f"{corrupted.shape[1]}: patching needs prompts of one length")
        metric = patching.logit_diff_metric([self.token(request.answer)], [self.token(request.wrong)])
        return clean, corrupted, metric

    def sae(self, name: str) -> nn.Module:
        if name not in self.saes:
            raise ValueError(f"no SAE or transcoder named {name!r}; the server has {sorted(self.saes) or 'none'}")
        return self.saes[name]

    # ---------------------------------------------------------------------------- jobs
    def submit(self, kind: str, work) -> dict:
        return self.queue.submit(kind, work)

    def job(self, job_id: str) -> Job:
        try:
            return self.queue.get(job_id)
        except KeyError:
            raise HTTPException(404, f"no job {job_id!r}") from None

    # ---------------------------------------------------------------------------- views
    def describe(self) -> dict:
        cfg, model = self.model.cfg, self.model
        names = sorted({n.rpartition(".")[2] for n in model.standard_hook_dict})
        return {"family": type(model).__name__, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                "num_kv_heads": cfg.num_kv_heads, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "soft_cap": getattr(cfg, "attn_soft_cap", None), "experts": getattr(cfg, "mlp_experts", None),
                "values": names, "data": [str(r) for r in self.roots],
                "saes": [self.sae_summary(name) for name in self.saes]}

    def sae_summary(self, name: str) -> dict:
        sae = self.saes[name]
        hook = sae_hook_name(sae)
        # "value": the hook in its standard spelling, as harvests and statistics name their columns
        value = self.model.resolve_hook_name(hook)[0] if hook in self.model.hook_dict else hook
        return {"name": name, "hook": hook, "value": value, "d_sae": int(sae.W_dec.shape[0]),
                "d_out": int(sae.W_dec.shape[1]), "layer": getattr(sae, "layer", None)}

    def prompt(self, request: PromptRequest) -> dict:
        if not 1 <= request.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k={request.top_k} is outside [1, {MAX_TOP_K}]")
        tokens = self.tokens(request.prompt)
        with self.lock, torch.no_grad():
            logits, cache = self.model.run_with_cache(tokens)
            probs = logits[0].float().softmax(-1)
            top = probs.topk(request.top_k, dim=-1)
            answer = self.token(request.answer) if request.answer else int(top.indices[-1, 0])
            lens = cache.logit_lens(positions=None, targets=[answer], return_type="probs")
        to_str = self.model.to_str_tokens
        return {"tokens": to_str(tokens[0]), "answer": to_str([answer])[0], "answer_id": answer,
                "top": [[{"token": t, "id": int(i), "prob": float(p)} for t, i, p in zip(to_str(ids), ids, ps)]
                        for ids, ps in zip(top.indices, top.values)],
                "lens_labels": list(lens.labels), "lens_probs": lens.values[:, 0, :, 0].tolist(),
                "lens_ranks": lens.readout.target_ranks[:, 0, :, 0].tolist()}

    def attention(self, request: PromptRequest) -> dict:
        tokens, model = self.tokens(request.prompt), self.model
        cfg = model.cfg
        wanted = ("attention_probabilities", "attention_raw_scores", "attention_scores", "mlp_expert_index")
        with self.lock, torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(wanted))

        def per_layer(leaf: str):
            found = [n for n in cache.keys() if n.endswith(leaf)]
            return [finite_list(cache[n][0]) for n in sorted(found, key=lambda n: int(n.split(".")[1]))] or None

        group = cfg.num_heads // cfg.num_kv_heads
        return {"tokens": model.to_str_tokens(tokens[0]), "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                "num_kv_heads": cfg.num_kv_heads, "kv_head": [h // group for h in range(cfg.num_heads)],
                "patterns": per_layer("attention_probabilities"),
                # alpha-er: the scores before its soft cap (cap·tanh(s/cap)) and after, and each position's expert
                "soft_cap": getattr(cfg, "attn_soft_cap", None), "raw_scores": per_layer("attention_raw_scores"),
                "scores": per_layer("attention_scores") if getattr(cfg, "attn_soft_cap", None) else None,
                "experts": per_layer("mlp_expert_index")}

    def patch(self, request: PatchRequest) -> dict:
        clean, corrupted, metric = self.pair(request)
        patching.find_sites(self.model, request.value)  # an unknown value is refused now, not in the job

        def work(job):
            result = patching.activation_patch(self.model, clean, corrupted, metric, request.value, request.over,
                                               direction=request.direction, progress=False)
            span = result.clean_metric != result.corrupted_metric
            return {"values": result.values.tolist(), "axes": list(result.axes), "labels": result.labels,
                    "value": result.value, "direction": result.direction, "clean_metric": result.clean_metric,
                    "corrupted_metric": result.corrupted_metric,
                    "normalized": result.normalized().tolist() if span else None}

        return self.submit("patch", work)

    def circuit(self, request: CircuitRequest) -> dict:
        clean, corrupted, metric = self.pair(request)

        def work(job):
            graph = circuits.edge_attribution(self.model, clean, corrupted, metric, request.method, request.steps)
            order = graph.scores.abs().argsort(descending=True, stable=True).tolist()
            ks = sorted({k for k in (0, 1, 2, 3, 5, 10, 15, 20, 30, 50, 100, 200, len(graph)) if k <= len(graph)})
            job.progress = 0.5
            curve = graph.faithfulness_curve(self.model, clean, corrupted, metric, ks)
            return {"edges": [{"writer": graph.edges[i][0], "reader": graph.edges[i][1],
                               "score": float(graph.scores[i])} for i in order],
                    "method": graph.method, "clean_metric": graph.clean_metric,
                    "corrupted_metric": graph.corrupted_metric, "sizes": graph.sizes, "ks": ks,
                    "faithfulness": curve.tolist()}

        return self.submit("circuit", work)

    def edge(self, request: EdgeRequest) -> dict:
        clean, corrupted, metric = self.pair(request)
        with self.lock:
            clean_metric, patched = circuits.edge_patch(self.model, clean, corrupted, metric,
                                                        [[], [(request.writer, request.reader)]]).tolist()
        return {"writer": request.writer, "reader": request.reader, "edge_patch": patched,
                "clean_metric": clean_metric, "effect": patched - clean_metric}

    def files(self, path: str | None) -> dict:
        if not path:
            return {"path": None, "entries": [self._entry(r, str(r)) for r in self.roots]}
        directory = self.path(path)
        if not directory.is_dir():
            raise ValueError(f"{path!r} is not a directory")
        return {"path": str(directory),
                "entries": [self._entry(p, str(p)) for p in sorted(directory.iterdir()) if not p.name.startswith(".")]}

    @staticmethod
    def _entry(path: Path, shown: str) -> dict:
        kind = ("harvest" if (path / "manifest.json").is_file() else "statistics" if (path / STATISTICS).is_file()
                else "directory") if path.is_dir() else (
            "json" if path.suffix == ".json" else "file")
        entry = {"name": path.name or shown, "path": shown, "kind": kind}
        if kind in ("harvest", "statistics"):  # the values it holds: the features view picks one that fits its SAE
            entry["values"] = _values_held(path, kind)
        return entry

    def graph(self, request: GraphRequest) -> dict:
        path = self.path(request.path)
        if not path.is_file():
            raise ValueError(f"{request.path!r} is not a file")
        if path.stat().st_size > MAX_GRAPH_BYTES:
            raise ValueError(f"{request.path!r} is {path.stat().st_size} bytes, over the {MAX_GRAPH_BYTES} a graph "
                             "file may have")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{request.path!r} does not parse as JSON: {error}") from None
        try:
            graph = GraphFile.model_validate(data)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()[:5])
            raise ValueError(f"{request.path!r} is not an attribution graph in circuit-tracer's schema: "
                             f"{problems}") from None
        graph = graph.checked().model_dump()
        if "hooked_models" in data:  # written by AttributionGraph.to_json: its per-head loadings come along
            _attach_head_loadings(graph["links"], AttributionGraph.from_json(path))
        _attach_examples(graph["nodes"], path.parent)
        return graph

    def dashboard(self, request: FeatureRequest) -> dict:
        sae, harvest = self.sae(request.sae), self.path(request.harvest)
        features.check_feature(request.feature, int(sae.W_dec.shape[0]))
        if (harvest / STATISTICS).is_file():  # a features.statistics result: the feature is read, not computed
            layer = features.FeatureStatistics.load(harvest)[sae_hook_name(sae)]
            return self.submit("dashboard", lambda job: {**layer.board(request.feature), "sae": request.sae})

        def work(job):
            board = features.dashboard(self.model, harvest, sae, request.feature,
                                       progress=lambda done: setattr(job, "progress", done))
            return {**asdict(board), "sae": request.sae}

        return self.submit("dashboard", work)

    def search(self, request: SearchRequest) -> dict:
        sae, harvest = self.sae(request.sae), self.path(request.harvest)
        if not 1 <= request.k <= MAX_TOP_K:
            raise ValueError(f"k={request.k} is outside [1, {MAX_TOP_K}]")
        token = self.token(request.token)

        def work(job):
            found = features.search_by_token(self.model, harvest, sae, token, k=request.k,
                                             progress=lambda done: setattr(job, "progress", done))
            return {"token": request.token, "features": found, "sae": request.sae}

        return self.submit("search", work)


# Top examples per feature node shown on hover in the graph view.
HOVER_EXAMPLES = 3


def _attach_examples(nodes: list[dict], directory: Path) -> None:
    """Each transcoder node's top windows as text ("[peak]" marked), from the first `features.statistics`
    result in the graph's directory (sorted by name; none: no examples); a layer it lacks gets none."""
    found = sorted(p for p in directory.iterdir() if p.is_dir() and (p / STATISTICS).is_file())
    if not found:
        return
    stats = features.FeatureStatistics.load(found[0])
    for node in nodes:
        if "transcoder" not in node.get("feature_type", ""):
            continue
        layer, feature = int(node["layer"]), int(node["node_id"].split("_")[1])
        try:
            windows = stats[layer].top_windows(feature)[:HOVER_EXAMPLES]
        except (KeyError, IndexError):
            continue
        node["examples"] = ["".join(f"[{t}]" if i == w.position - w.start else t for i, t in enumerate(w.tokens))
                            for w in windows]


def _values_held(path: Path, kind: str) -> list[str]:
    """The hooks a harvest holds (its manifest's names) or a statistics result has layers of; none if unreadable."""
    try:
        if kind == "harvest":
            return list(json.loads((path / "manifest.json").read_text())["names"])
        return [layer["name"] for layer in json.loads((path / STATISTICS).read_text())["layers"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _per_layer(saes: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """The features view's modules by name: a TranscoderSet offers each layer's transcoder, as "name[layer]"."""
    modules = {}
    for name, module in saes.items():
        if isinstance(module, TranscoderSet):
            modules.update({f"{name}[{tc.layer}]": tc for tc in module})
        elif hasattr(module, "encode") and hasattr(module, "W_dec") and module.W_dec.ndim == 2:
            modules[name] = module
        else:
            raise ValueError(f"{name!r} is not an SAE or a transcoder set (a module with encode and a "
                             f"W_dec [d_sae d_out]; a cross-layer transcoder's decoders are not offered)")
    return modules


def _attach_head_loadings(links: list[dict], graph: AttributionGraph) -> None:
    """Give each link through attention its per-head split, `heads`: {"layers.L.self_attn.head.h": part, ...,
    "layers.L.self_attn (skipped)": the part that skips L's attention}, for each attention layer L the edge
    crosses (the heads' parts plus the skip are the edge, per layer), nonzero entries only."""
    if graph.head_loadings is None:
        return
    index = {json_node(graph, i)["node_id"]: i for i in range(graph.n_nodes)}
    for link in links:
        target, source = index[link["target"]], index[link["source"]]
        loadings, skips = graph.head_loadings[target, source], graph.attention_skips[target, source]
        heads = {}
        for layer in range(loadings.shape[0]):
            if bool(loadings[layer].any()):
                for head, part in enumerate(loadings[layer].tolist()):
                    heads[f"layers.{layer}.self_attn.head.{head}"] = part
                heads[f"layers.{layer}.self_attn (skipped)"] = float(skips[layer])
        if heads:
            link["heads"] = heads


def load_sae(path: str | Path, model) -> nn.Module:
    """The SAE or transcoders saved at `path`: a transcoder set in circuit-tracer's layout (config.yaml;
    `transcoders.load_transcoders`, "embedded" for the package's own), or an SAE SAELens saved (cfg.json and
    sae_weights.safetensors), loaded by SAELens."""
    if str(path) == "embedded" or (Path(path) / "config.yaml").is_file():
        from hooked_models.transcoders import load_transcoders

        return load_transcoders(path, model)
    path = Path(path)
    if not (path / "cfg.json").is_file():
        raise ValueError(f"{path} is neither a transcoder set (config.yaml) nor a SAELens SAE directory (cfg.json)")
    try:
        from sae_lens import SAE
    except ImportError:
        raise ImportError(f"loading the SAE at {path} needs sae_lens (the package's `sae` extra)") from None
    return SAE.load_from_disk(str(path))


# ----------------------------------------------------------------------------------------------- app
def create_app(model, data: Sequence[str | Path] = (), saes: Mapping[str, nn.Module] | None = None) -> FastAPI:
    """The explorer as an ASGI app: serve it with `uvicorn.run(app, host="127.0.0.1", port=8000)`.

    model: a hooked model (its tokenizer is needed). data: the directories whose files (harvests, graph
    files) the page may open. saes: SAEs and transcoders by name (modules with encode and W_dec).
    """
    explorer = Explorer(model, data, saes)
    app = FastAPI(title="hooked_models explorer", docs_url="/api/docs", openapi_url="/api/openapi.json")
    app.state.explorer = explorer

    @app.exception_handler(RefusedPath)
    async def refused(request: Request, error: RefusedPath):
        return JSONResponse({"error": str(error)}, status_code=403)

    # A bad value (an unknown token, a value name the model lacks, prompts of two lengths) is the
    # library's ValueError (UnknownHookError is one too): the page shows its message.
    @app.exception_handler(ValueError)
    async def bad_input(request: Request, error: ValueError):
        return JSONResponse({"error": message(error)}, status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return JSONResponse({"error": error.detail}, status_code=error.status_code)

    # Plain `def` routes run in the framework's thread pool, so a computation never blocks the event loop.
    @app.get("/api/model")
    def describe():
        return explorer.describe()

    routes = {"/api/prompt": (explorer.prompt, PromptRequest), "/api/attention": (explorer.attention, PromptRequest),
              "/api/patch": (explorer.patch, PatchRequest), "/api/circuit": (explorer.circuit, CircuitRequest),
              "/api/edge": (explorer.edge, EdgeRequest), "/api/graph": (explorer.graph, GraphRequest),
              "/api/features/dashboard": (explorer.dashboard, FeatureRequest),
              "/api/features/search": (explorer.search, SearchRequest)}
    for route, (handler, body) in routes.items():
        app.add_api_route(route, _endpoint(handler, body), methods=["POST"])

    @app.get("/api/files")
    def files(path: str | None = None):
        return explorer.files(path)

    @app.get("/api/jobs/{job_id}")
    def job(job_id: str):
        return explorer.job(job_id).status()

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _endpoint(handler, body: type[BaseModel]):
    """A POST route taking the request model `body` as its JSON body."""

    def endpoint(request: body):  # type: ignore[valid-type]
        return handler(request)

    endpoint.__annotations__ = {"request": body}
    return endpoint
