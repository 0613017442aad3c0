"""The explorer's server: a JSON API over the library's own functions, and the page's static files.

Every number it sends is computed by the package (`run_with_cache`, `cache.logit_lens`,
`patching.activation_patch`, `circuits.edge_attribution` / `edge_patch` / `faithfulness_curve`,
`features.dashboard` / `search_by_token`, a saved `features.statistics` result read feature by feature);
the server only parses requests, runs them and sends the
results as JSON. Long computations (patching, circuits, feature passes over a harvest) are background jobs
(`jobs.py`: a queue on a replica of the model sharing its weights, so the views never wait for a job): a
request returns the job's id at once, the page polls `/api/jobs/{id}`, `DELETE /api/jobs/{id}` cancels.
Every size a request sets is bounded (`requests.py`, stated in /api/openapi.json) and every change made
to a prompt is said (`prompts.py`: the `notices` field of each response).

Safety: files are read only under the directories given (`data`), resolved with symlinks followed, so
`..` or a link out is refused; files are parsed as JSON or safetensors, never unpickled; no request
names code to run (values and edges are looked up in the model's own tables).
"""

import json
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn
import yaml
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError

from hooked_models import circuits, features, patching
from hooked_models.attribution import AttributionGraph
from hooked_models.explorer.graph_file import GraphFile, attach_examples, attach_head_loadings, attach_spread
from hooked_models.explorer.jobs import Jobs, message
from hooked_models.explorer.prompts import Prompt, read_pair, read_prompt
from hooked_models.explorer.requests import Limits, request_models, validation_message
from hooked_models.explorer.subgraphs import PREFIX as SUBGRAPH_ROUTES, Subgraphs, Unprocessable
from hooked_models.features.circuit_tracer_files import FEATURE_NODE, METADATA as GRAPH_LIST
from hooked_models.features.results import META as STATISTICS
from hooked_models.transcoders import TranscoderSet, load_transcoders
from hooked_models.sae_metadata import sae_hook_name

STATIC = Path(__file__).parent / "static"


class RefusedPath(ValueError):
    """A path outside the directories the server was given."""


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
        self.transcoder_sets = {name: m for name, m in (saes or {}).items() if isinstance(m, TranscoderSet)}
        self.limits = Limits.of(self.model)
        self.queue = Jobs(self.model)
        self.subgraphs = Subgraphs(self)

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

    def pair(self, request):
        """The request's clean and corrupted prompts, and the logit difference at the last real position."""
        clean, corrupted = read_pair(self.model, request.clean, request.corrupted)
        metric = patching.logit_diff_metric([self.token(request.answer)], [self.token(request.wrong)],
                                            position=clean.real - 1)
        return clean, corrupted, metric

    def sae(self, name: str) -> nn.Module:
        if name not in self.saes:
            raise ValueError(f"no SAE or transcoder named {name!r}; the server has {sorted(self.saes) or 'none'}")
        return self.saes[name]

    # ---------------------------------------------------------------------------- jobs
    def submit(self, kind: str, work) -> dict:
        """Queue `work(model, job)`, run on the jobs' replica of the model."""
        return self.queue.submit(kind, work)

    def job(self, job_id: str, cancel: bool = False) -> dict:
        try:
            return self.queue.cancel(job_id) if cancel else self.queue.status(job_id)
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
                "saes": [self.sae_summary(name) for name in self.saes], "limits": self.limits.as_dict()}

    def sae_summary(self, name: str) -> dict:
        sae = self.saes[name]
        hook = sae_hook_name(sae)
        # "value": the hook in its standard spelling, as harvests and statistics name their columns
        value = self.model.resolve_hook_name(hook)[0] if hook in self.model.hook_dict else hook
        return {"name": name, "hook": hook, "value": value, "d_sae": int(sae.W_dec.shape[0]),
                "d_out": int(sae.W_dec.shape[1]), "layer": getattr(sae, "layer", None)}

    def prompt(self, request) -> dict:
        prompt = read_prompt(self.model, request.prompt)
        tokens = prompt.tokens
        with self.queue.views(), torch.no_grad():
            logits, cache = self.model.run_with_cache(tokens)
            probs = logits[0].float().softmax(-1)
            top = probs.topk(request.top_k, dim=-1)
            answer = self.token(request.answer) if request.answer else int(top.indices[prompt.real - 1, 0])
            lens = cache.logit_lens(positions=None, targets=[answer], return_type="probs")
        to_str = self.model.to_str_tokens
        return {**prompt.fields(self.model), "answer": to_str([answer])[0], "answer_id": answer,
                "top": [[{"token": t, "id": int(i), "prob": float(p)} for t, i, p in zip(to_str(ids), ids, ps)]
                        for ids, ps in zip(top.indices, top.values)],
                "lens_labels": list(lens.labels), "lens_probs": lens.values[:, 0, :, 0].tolist(),
                "lens_ranks": lens.readout.target_ranks[:, 0, :, 0].tolist()}

    def attention(self, request) -> dict:
        prompt, model = read_prompt(self.model, request.prompt), self.model
        cfg = model.cfg
        wanted = ("attention_probabilities", "attention_raw_scores", "attention_scores", "mlp_expert_index")
        with self.queue.views(), torch.no_grad():
            _, cache = model.run_with_cache(prompt.tokens, names_filter=lambda n: n.endswith(wanted))

        def per_layer(leaf: str):
            found = [n for n in cache.keys() if n.endswith(leaf)]
            return [finite_list(cache[n][0]) for n in sorted(found, key=lambda n: int(n.split(".")[1]))] or None

        group = cfg.num_heads // cfg.num_kv_heads
        return {**prompt.fields(model), "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                "num_kv_heads": cfg.num_kv_heads, "kv_head": [h // group for h in range(cfg.num_heads)],
                "patterns": per_layer("attention_probabilities"),
                # alpha-er: the scores before its soft cap (cap·tanh(s/cap)) and after, and each position's expert
                "soft_cap": getattr(cfg, "attn_soft_cap", None), "raw_scores": per_layer("attention_raw_scores"),
                "scores": per_layer("attention_scores") if getattr(cfg, "attn_soft_cap", None) else None,
                "experts": per_layer("mlp_expert_index")}

    def patch(self, request) -> dict:
        clean, corrupted, metric = self.pair(request)
        self.check_sweep(clean, request.value, request.over)  # an unknown value or a sweep too big: refused now
        labels = self.model.to_str_tokens(clean.tokens[0])  # the heatmap's positions by their tokens

        def work(model, job):
            result = patching.activation_patch(model, clean.tokens, corrupted.tokens, metric, request.value,
                                               request.over, direction=request.direction, progress=job.report,
                                               position_labels=labels)
            span = result.clean_metric != result.corrupted_metric
            return {"values": result.values.tolist(), "axes": list(result.axes), "labels": result.labels,
                    "value": result.value, "direction": result.direction, "clean_metric": result.clean_metric,
                    "corrupted_metric": result.corrupted_metric,
                    "normalized": result.normalized().tolist() if span else None,
                    "notices": clean.notices + corrupted.notices}

        return self.submit("patch", work)

    def check_sweep(self, prompt: Prompt, value: str, over) -> None:
        """A ValueError unless the sweep of `value` over `over` has at most `limits.patches` patches: its
        grid, planned from the sizes one forward gives (no patched run)."""
        sites = patching.find_sites(self.model, value)
        with self.queue.views(), torch.no_grad():
            _, cache = self.model.run_with_cache(prompt.tokens, names_filter=[s.name for s in sites])
        sizes = [dict(zip(s.value.dims[1:], cache[s.name].shape[1:])) for s in sites]
        _, patches = patching.plan(self.model, sites, over, None, sizes)
        if len(patches) > self.limits.patches:
            raise ValueError(f"the sweep of {value} over {over or 'its default axes'} is {len(patches)} patches, "
                             f"over the bound {self.limits.patches}: sweep fewer axes")

    def circuit(self, request) -> dict:
        clean, corrupted, metric = self.pair(request)

        def work(model, job):
            graph = circuits.edge_attribution(model, clean.tokens, corrupted.tokens, metric, request.method,
                                              request.steps, progress=job.report)
            order = graph.scores.abs().argsort(descending=True, stable=True).tolist()
            ks = sorted({k for k in (0, 1, 2, 3, 5, 10, 15, 20, 30, 50, 100, 200, len(graph)) if k <= len(graph)})
            curve = graph.faithfulness_curve(model, clean.tokens, corrupted.tokens, metric, ks, progress=job.report)
            return {"edges": [{"writer": graph.edges[i][0], "reader": graph.edges[i][1],
                               "score": float(graph.scores[i])} for i in order],
                    "method": graph.method, "clean_metric": graph.clean_metric,
                    "corrupted_metric": graph.corrupted_metric, "sizes": graph.sizes, "ks": ks,
                    "faithfulness": curve.tolist(), "notices": clean.notices + corrupted.notices}

        return self.submit("circuit", work)

    def edge(self, request) -> dict:
        clean, corrupted, metric = self.pair(request)
        with self.queue.views():
            clean_metric, patched = circuits.edge_patch(self.model, clean.tokens, corrupted.tokens, metric,
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
                "entries": [self._entry(p, self._shown(p)) for p in sorted(directory.iterdir())
                            if not p.name.startswith(".")]}

    def _shown(self, path: Path) -> str:
        """A path as the page shows and sends it: relative to the first data directory (where `path` resolves
        relative paths) when it lies under it, else whole."""
        return str(path.relative_to(self.roots[0])) if self.roots and self.roots[0] in path.parents else str(path)

    @staticmethod
    def _entry(path: Path, shown: str) -> dict:
        # circuit-tracer's graph-metadata.json lists the graphs of its directory: JSON, but not a graph
        kind = ("harvest" if (path / "manifest.json").is_file() else "statistics" if (path / STATISTICS).is_file()
                else "directory") if path.is_dir() else (
            "graph list" if path.name == GRAPH_LIST else "json" if path.suffix == ".json" else "file")
        entry = {"name": path.name or shown, "path": shown, "kind": kind}
        if kind in ("harvest", "statistics"):  # the values it holds: the features view picks one that fits its SAE
            entry["values"] = _values_held(path, kind)
        return entry

    def graph_path(self, name: str) -> Path:
        """The graph file `name`, under the data directories and within the size bound."""
        path = self.path(name)
        if not path.is_file():
            raise ValueError(f"{name!r} is not a file")
        if path.stat().st_size > self.limits.graph_bytes:
            raise ValueError(f"{name!r} is {path.stat().st_size} bytes, over the bound "
                             f"{self.limits.graph_bytes} a graph file may have")
        return path

    def graph(self, request) -> dict:
        path = self.graph_path(request.path)
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
        self._name_nodes(graph)
        # The whole graph is in the file (AttributionGraph.to_json, its tensors beside it; a copy moved without
        # them, as into circuit-tracer's viewer's folder, is drawn as any graph file): supernodes' edges,
        # interventions, per-head loadings and QK can be read.
        side = data["hooked_models"].get("tensors") if isinstance(data.get("hooked_models"), dict) else None
        # a bare file name, as to_json writes it (a path would reach out of the file's folder)
        graph["whole_graph"] = isinstance(side, str) and Path(side).name == side and (path.parent / side).is_file()
        if graph["whole_graph"]:
            attach_head_loadings(graph["links"], AttributionGraph.from_json(path))
            graph["qk_attributions"] = data.get("qk_attributions", [])
        attach_examples(graph["nodes"], path.parent)
        if "hooked_models_aggregate" in data["metadata"]:  # `aggregate(store).to_json`: each node over the prompts
            attach_spread(graph, data)
        return graph

    def _name_nodes(self, graph: dict) -> None:
        """Add what the page names nodes by: a logit's token (`logit_token`, the served model's text for its
        id) and, where the graph's transcoders are a set the server serves, the features' kind
        (`feature_kind`: the schema's one feature_type string says "cross layer transcoder" for every kind)."""
        hooks = list(graph["metadata"]["transcoder_list"])
        per_layer = any(hooks == [ts.input_hook(layer) for layer in range(ts.n_layers)]
                        for ts in self.transcoder_sets.values())
        for node in graph["nodes"]:
            if node["feature_type"] == "logit" and 0 <= node["feature"] < self.model.cfg.vocab_size:
                node["logit_token"] = self.model.to_str_tokens([node["feature"]])[0]
            elif node["feature_type"] == "cross layer transcoder" and per_layer:
                node["feature_kind"] = "per-layer transcoder"

    def dashboard(self, request) -> dict:
        sae, harvest = self.sae(request.sae), self.path(request.harvest)
        features.check_feature(request.feature, int(sae.W_dec.shape[0]))
        if (harvest / STATISTICS).is_file():  # a features.statistics result: the feature is read, not computed
            layer = features.FeatureStatistics.load(harvest)[sae_hook_name(sae)]
            return self.submit("dashboard", lambda model, job: {**layer.board(request.feature), "sae": request.sae})

        def work(model, job):
            board = features.dashboard(model, harvest, sae, request.feature, progress=job.report)
            return {**asdict(board), "sae": request.sae}

        return self.submit("dashboard", work)

    def search(self, request) -> dict:
        sae, harvest = self.sae(request.sae), self.path(request.harvest)
        token = self.token(request.token)

        def work(model, job):
            found = features.search_by_token(model, harvest, sae, token, k=request.k, progress=job.report)
            return {"token": request.token, "features": found, "sae": request.sae}

        return self.submit("search", work)


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


def load_sae(path: str | Path, model) -> nn.Module:
    """The SAE or transcoders saved at `path`: a transcoder set in circuit-tracer's layout (config.yaml;
    `transcoders.load_transcoders`, "embedded" for the package's own), or an SAE SAELens saved (cfg.json and
    sae_weights.safetensors), loaded by SAELens."""
    if str(path) == "embedded" or (Path(path) / "config.yaml").is_file():
        return load_transcoders(path, model)
    path = Path(path)
    if not (path / "cfg.json").is_file():
        raise ValueError(f"{path} is neither a transcoder set (config.yaml) nor a SAELens SAE directory (cfg.json)")
    try:
        from sae_lens import SAE
    except ImportError:
        raise ImportError(f"loading the SAE at {path} needs sae_lens (the package's `sae` extra)") from None
    return SAE.load_from_disk(str(path))


def graph_transcoders(model, data: Sequence[str | Path], embedded: bool) -> tuple[dict[str, nn.Module], list[str]]:
    """With no SAE named: the transcoder sets the graph files in the `data` directories were built with, where
    they are at hand: the package's own ("embedded", when the model is the embedded one) and every transcoder
    set (config.yaml) in a data directory or a folder of one, by name ("embedded", or the folder's).

    A set is a graph's when its input hooks are the graph's `transcoder_list` and it gives the graph's
    feature nodes their activations: for a graph `to_json` wrote (its tokens kept), the set encodes the
    model's run on those tokens to each node's activation (within 1e-4 of it, relative); for another
    graph file, every node's feature index is below the set's width. Returns the sets and a line for each
    graph no set fits (or a set that did not load), to tell the user."""
    graphs = _graph_files(data, Limits.of(model).graph_bytes)
    candidates = {"embedded": "embedded"} if embedded else {}
    for root in data:
        for config in sorted([*Path(root).glob("config.yaml"), *Path(root).glob("*/config.yaml")]):
            candidates.setdefault(config.parent.name, str(config.parent))
    offered, notes, fitted = {}, [], set()
    if not graphs:
        return offered, notes
    for name, source in candidates.items():
        try:
            found = load_transcoders(source, model)
        except (OSError, ValueError, KeyError, yaml.YAMLError) as error:
            notes.append(f"{source}: not loaded as transcoders ({error})")
            continue
        # the features view opens a per-layer set's features (a cross-layer transcoder's are not offered)
        fits = [file for file, graph in graphs.items()
                if isinstance(found, TranscoderSet) and _fits(model, found, graph)]
        if fits:
            offered[name] = found
            fitted.update(fits)
    notes += [f"{file}: no transcoder set at hand gives its features' activations (name its set with --sae DIR)"
              for file in graphs if file not in fitted]
    return offered, notes


def _graph_files(data: Sequence[str | Path], too_big: int) -> dict[str, dict]:
    """The graph files (their `metadata.transcoder_list` not empty) at the top of the data directories, by
    name, parsed; a file over `too_big` bytes (the graph view's own bound) is not read."""
    graphs = {}
    for root in data:
        for path in sorted(Path(root).glob("*.json")):
            if path.name == GRAPH_LIST or path.stat().st_size > too_big:
                continue
            try:
                graph = json.loads(path.read_text())
                if graph["metadata"]["transcoder_list"] and isinstance(graph["nodes"], list):
                    graphs.setdefault(path.name, graph)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a graph file: the graph view says why when it is opened
    return graphs


def _fits(model, transcoders: TranscoderSet, graph: dict) -> bool:
    """Whether `transcoders` are the ones `graph` (a parsed graph file) was built with (graph_transcoders)."""
    hooks = [transcoders.input_hook(layer) for layer in range(transcoders.n_layers)]
    if list(graph["metadata"]["transcoder_list"]) != hooks:
        return False
    nodes = [(int(n["layer"]), int(n["node_id"].split("_")[1]), int(n["ctx_idx"]), n.get("activation"))
             for n in graph["nodes"] if n.get("feature_type") == FEATURE_NODE]
    if any(not 0 <= layer < len(hooks) or not 0 <= f < transcoders[layer].d_transcoder for layer, f, _, _ in nodes):
        return False
    tokens = (graph.get("hooked_models") or {}).get("tokens")
    if not tokens or not nodes:
        return True
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([tokens]), names_filter=hooks)
        for layer, feature, pos, activation in nodes:
            value = float(transcoders[layer].encode(cache[hooks[layer]][0, pos])[feature])
            if activation is None or abs(value - activation) > 1e-4 * max(abs(activation), 1e-6):
                return False
    return True


# ----------------------------------------------------------------------------------------------- app
def create_app(model, data: Sequence[str | Path] = (), saes: Mapping[str, nn.Module] | None = None) -> FastAPI:
    """The explorer as an ASGI app: serve it with `uvicorn.run(app, host="127.0.0.1", port=8000)`.

    model: a hooked model (its tokenizer is needed). data: the directories whose files (harvests, graph
    files) the page may open. saes: SAEs and transcoders by name (modules with encode and W_dec).
    """
    explorer = Explorer(model, data, saes)
    bodies = request_models(explorer.limits)

    @asynccontextmanager
    async def lifespan(app):
        yield
        explorer.queue.shutdown()  # the server stops: every job is cancelled at its next batch

    app = FastAPI(title="hooked_models explorer", docs_url="/api/docs", openapi_url="/api/openapi.json",
                  lifespan=lifespan)
    app.state.explorer = explorer

    @app.exception_handler(RefusedPath)
    async def refused(request: Request, error: RefusedPath):
        return JSONResponse({"error": str(error)}, status_code=403)

    # A bad value (an unknown token, a value name the model lacks, prompts of two lengths) is the
    # library's ValueError (UnknownHookError is one too): the page shows its message.
    @app.exception_handler(ValueError)
    async def bad_input(request: Request, error: ValueError):
        return JSONResponse({"error": message(error)}, status_code=400)

    # A subgraph that parses but is none of its graph's (a node not in it, an empty supernode, ...): 422.
    @app.exception_handler(Unprocessable)
    async def unprocessable(request: Request, error: Unprocessable):
        return JSONResponse({"error": message(error)}, status_code=422)

    # A body the request model refuses (a value outside its bound, the wrong type, a field the request does not
    # have): 422, as FastAPI answers, with one message naming each value and its bound instead of pydantic's list.
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return JSONResponse({"error": validation_message(error.errors())}, status_code=422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return JSONResponse({"error": error.detail}, status_code=error.status_code)

    # Plain `def` routes run in the framework's thread pool, so a computation never blocks the event loop.
    @app.get("/api/model")
    def describe():
        return explorer.describe()

    routes = {"/api/prompt": (explorer.prompt, "PromptRequest"),
              "/api/attention": (explorer.attention, "PromptRequest"),
              "/api/patch": (explorer.patch, "PatchRequest"), "/api/circuit": (explorer.circuit, "CircuitRequest"),
              "/api/edge": (explorer.edge, "EdgeRequest"), "/api/graph": (explorer.graph, "GraphRequest"),
              "/api/features/dashboard": (explorer.dashboard, "FeatureRequest"),
              "/api/features/search": (explorer.search, "SearchRequest"),
              SUBGRAPH_ROUTES: (explorer.subgraphs.show, "SubgraphRequest"),
              f"{SUBGRAPH_ROUTES}/save": (explorer.subgraphs.save, "SubgraphRequest"),
              f"{SUBGRAPH_ROUTES}/import": (explorer.subgraphs.load, "SubgraphImportRequest"),
              f"{SUBGRAPH_ROUTES}/interventions": (explorer.subgraphs.interventions, "InterventionRequest")}
    for route, (handler, body) in routes.items():
        app.add_api_route(route, _endpoint(handler, bodies[body]), methods=["POST"])

    @app.get("/api/files")
    def files(path: str | None = None):
        return explorer.files(path)

    @app.get("/api/jobs")
    def jobs():
        return {"jobs": explorer.queue.listing()}

    @app.get("/api/jobs/{job_id}")
    def job(job_id: str):
        return explorer.job(job_id)

    @app.delete("/api/jobs/{job_id}")
    def cancel(job_id: str):
        return explorer.job(job_id, cancel=True)

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
