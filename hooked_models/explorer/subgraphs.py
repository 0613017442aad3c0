"""The explorer's subgraph routes: nodes of the graph view grouped into named supernodes, the graph of the
parts, the interventions that test them as a job, and the subgraph saved into its graph file and read back.

A view over `attribution.Subgraph` and `intervene_supernodes`, computing nothing itself: it rebuilds the
graph from the file `AttributionGraph.to_json` wrote (the whole graph, from the tensors beside it: a part's
edges and the interventions need every node and edge, not the pruned links the page draws), builds the
`Subgraph` the request describes, and sends back what the library computed.

    POST /api/subgraph               {path, supernodes: [[name, *node ids]], pinned: [ids]} -> parts, edges
    POST /api/subgraph/save          the same, written into the graph file's qParams (`Subgraph.save`)
    POST /api/subgraph/import        {path, source}: the subgraph of another copy of the graph's file, such as
                                     the one circuit-tracer's viewer saved (`Subgraph.load`, refused if the
                                     file is another graph's)
    POST /api/subgraph/interventions the subgraph, scales, modes, ...: a job of `intervene_supernodes`

Refusals are 422 (`Unprocessable`): a body that parses but describes no subgraph of this graph (a node not in
it, an empty supernode, a node in two, two parts of one name, a file of another graph; and, through the body's
schema, a scale that is not a number), one line naming the value. The server otherwise only reads: `save` is
its one write, the qParams of a graph file under the data directories, checked to be this graph's.
"""

import math
import threading
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

from hooked_models.attribution import MODES, AttributionGraph, Subgraph, intervene_supernodes
from hooked_models.attribution.export import node_id
from hooked_models.attribution.replacement import transcoder_names

# Routes under this prefix answer a bad value with 422 (server.py's handlers read it).
PREFIX = "/api/subgraph"
GRAPHS_KEPT = 4  # rebuilt graphs kept in memory, by file and modification time (the page asks again and again)


class Unprocessable(ValueError):
    """A request that parses but names no subgraph of its graph: answered 422 with the message."""


def _refused(error: ValueError) -> Unprocessable:
    return Unprocessable(str(error))


class Subgraphs:
    """The subgraph routes of an `Explorer` (its paths, its tokens, its jobs and its transcoder sets)."""

    def __init__(self, explorer):
        self.explorer = explorer
        self._graphs: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------- inputs
    def whole_graph(self, path: str) -> tuple[Path, AttributionGraph]:
        """The graph file at `path` (under the data directories) and the whole graph it keeps."""
        resolved = self.explorer.graph_path(path)
        stamp = (resolved, resolved.stat().st_mtime_ns)
        with self._lock:
            if stamp in self._graphs:
                self._graphs.move_to_end(stamp)
                return resolved, self._graphs[stamp]
        try:
            graph = AttributionGraph.from_json(resolved)
        except ValueError as error:
            raise Unprocessable(f"{path!r} cannot hold supernodes here: {error}") from None
        with self._lock:
            self._graphs[stamp] = graph
            while len(self._graphs) > GRAPHS_KEPT:
                self._graphs.popitem(last=False)
        return resolved, graph

    def subgraph(self, request, existing: Subgraph | None = None) -> tuple[Path, Subgraph]:
        """The request's subgraph over its file's graph; the labels and other qParams (`view`) of `existing`."""
        path, graph = self.whole_graph(request.path)
        groups = []
        for entry in request.supernodes:
            if not entry or not entry[0]:
                raise Unprocessable(f"supernode {entry!r} has no name: each is [name, *node ids]")
            groups.append((entry[0], entry[1:]))
        try:
            sub = Subgraph(graph, groups, request.pinned, existing.labels if existing else None,
                           view=existing.view if existing else None)
        except ValueError as error:
            raise _refused(error) from None
        return path, sub

    def transcoders(self, graph: AttributionGraph) -> tuple[str | None, object]:
        """The served transcoder set the graph was attributed through (its hooks, as the graph names them)."""
        for name, module in self.explorer.transcoder_sets.items():
            if transcoder_names(module) == list(graph.transcoder_names):
                return name, module
        return None, None

    # ---------------------------------------------------------------------------- routes
    def show(self, request) -> dict:
        _, sub = self.subgraph(request)
        return self.describe(sub)

    def save(self, request) -> dict:
        path, graph = self.whole_graph(request.path)
        try:  # the file's labels and other qParams stay; qParams that do not read are replaced
            existing = Subgraph.load(path, graph)
        except ValueError:
            existing = None
        _, sub = self.subgraph(request, existing)
        try:
            sub.save(path)
        except ValueError as error:
            raise _refused(error) from None
        return self.describe(sub)

    def load(self, request) -> dict:
        _, graph = self.whole_graph(request.path)
        source = self.explorer.path(request.source)
        try:
            sub = Subgraph.load(source, graph)
        except ValueError as error:
            raise _refused(error) from None
        return self.describe(sub)

    def interventions(self, request) -> dict:
        _, sub = self.subgraph(request)
        name, transcoders = self.transcoders(sub.graph)
        if transcoders is None:
            raise Unprocessable(f"no transcoder set the server serves reads {sub.graph.transcoder_names}, the "
                                f"graph's transcoders: serve them (--sae) to intervene")
        for part in request.parts or []:
            try:
                sub.part(part)
            except ValueError as error:
                raise _refused(error) from None
        try:
            logit_diff = None if request.logit_diff is None else tuple(self.explorer.token(t) for t in request.logit_diff)
        except ValueError as error:
            raise _refused(error) from None
        graph = sub.graph

        def work(model, job):
            table = intervene_supernodes(model, graph.tokens, transcoders, sub, request.scales, parts=request.parts,
                                         modes=tuple(request.modes), logit_diff=logit_diff,
                                         batch_size=request.batch_size, progress=job.report)
            # JSON has no NaN: a prediction the graph cannot make (a logit difference off its outputs) is null
            rows = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(row).items()}
                    for row in table.rows]
            return {"rows": rows, "modes": list(table.modes), "transcoders": name,
                    "descriptions": {mode: MODES[mode] for mode in table.modes}}

        return self.explorer.submit("interventions", work)

    # ---------------------------------------------------------------------------- answers
    def describe(self, sub: Subgraph) -> dict:
        """What the page draws: each part (its members, where it sits, its influence), the edges between
        parts (row target, column source: sums of members' edges), the influence kept, the qParams a save
        writes, and the transcoder set interventions would use."""
        graph = sub.graph
        edges, influence, kept = sub.edges(), sub.influence(), sub.kept_influence()
        parts = []
        for k, part in enumerate(sub.parts):
            places = [graph.node_position(i) for i in part.nodes]
            # rows as the graph view draws them: embeddings 0, layer l at l + 1, the outputs above the last layer
            rows = [0 if layer is None else layer + 1 for layer, _ in places]
            parts.append({"name": part.name, "supernode": part.supernode,
                          "members": [graph.node_name(i) for i in part.nodes],
                          "ids": [node_id(graph, i) for i in part.nodes],
                          "row": sum(rows) / len(rows), "position": sum(p for _, p in places) / len(places),
                          "influence": float(influence[k])})
        return {"parts": parts, "edges": edges.tolist(), "kept": kept._asdict(), "qParams": sub.qparams(),
                "n_layers": graph.n_layers, "tokens": graph.str_tokens_or_ids(),
                "transcoders": self.transcoders(graph)[0]}
