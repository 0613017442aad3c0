"""A graph store: the attribution graphs of a dataset as plain files, one pair per graph as `to_json` writes
it (`graphs/00007.json`, circuit-tracer's graph file, and `graphs/00007.tensors.safetensors`, every node and
edge), and `index.json`: the model, the transcoders, the settings, each prompt (its text or tokens, its
target) and the graphs done.

    store = GraphStore("out/ioi")
    len(store); store.entries[3]          # {"prompt": ..., "tokens": [...], "target": [a, b] or None, ...}
    graph = store[3]                      # AttributionGraph.from_json: every node and edge
    store.graph_json(3)                   # the graph file as written (its pruned nodes and links)

A graph is written under a temporary name and renamed into place (its tensors first, then the JSON that
names them), and the index, rewritten whole after each graph, records it done only then: a run killed at
any point leaves whole graphs, which a rerun keeps, and nothing half-written.
"""

import json
import os
import uuid
from pathlib import Path

from hooked_models.attribution.graph import AttributionGraph
from hooked_models.attribution.replacement import transcoder_names
from hooked_models.corpus.source import weights_digest

INDEX = "index.json"
FORMAT = "hooked_models.attribution.graph_store/1"
# The fields of an index that must match for a run to continue a store.
IDENTITY = ("format", "model", "transcoders", "settings", "prompts")


def graph_file(i: int) -> str:
    """Graph i's JSON, relative to the store (its tensors beside it, `<stem>.tensors.safetensors`)."""
    return f"graphs/{i:05d}.json"


def transcoders_identity(transcoders) -> dict:
    """What makes two transcoder sets the same for a store: their kind, shape, the values they read, and
    a fingerprint of their weights."""
    return {"kind": type(transcoders).__name__, "n_layers": int(transcoders.n_layers),
            "d_transcoder": int(transcoders.d_transcoder), "names": transcoder_names(transcoders),
            "weights": weights_digest(transcoders)}


def refuse_other_store(existing: dict, job: dict, out: Path) -> None:
    """A one-line refusal naming the first field in which `out`'s index differs from this run's."""
    for key in IDENTITY:
        if existing.get(key) != job.get(key):
            if isinstance(job.get(key), dict):
                which = [k for k in job[key] if (existing.get(key) or {}).get(k) != job[key][k]]
                detail = f"its {' and '.join(which)} differ"
            elif key == "prompts":
                detail = f"{len(existing.get(key) or [])} prompts there, {len(job[key])} now, or other prompts"
            else:
                detail = f"{existing.get(key)!r} there, {job.get(key)!r} now"
            raise ValueError(f"{out} holds graphs of another job ({key}: {detail}); they are never mixed with this "
                             "run's: write into another directory, or delete it to start over")


def save_index(out: Path, index: dict) -> None:
    """The index rewritten whole: a temporary name, then renamed into place (never seen half-written)."""
    partial = out / f".{INDEX}.{uuid.uuid4().hex}"
    partial.write_text(json.dumps(index, indent=1))
    os.replace(partial, out / INDEX)


def write_graph(out: Path, i: int, graph: AttributionGraph, node_threshold: float, edge_threshold: float) -> None:
    """Graph i's file pair, as `graph.to_json` writes it, written in a private temporary directory and
    renamed into place: the tensors first, then the JSON that names them."""
    temporary = out / ".tmp" / uuid.uuid4().hex
    name = Path(graph_file(i))
    path = graph.to_json(temporary / name.name, slug=name.stem, node_threshold=node_threshold,
                         edge_threshold=edge_threshold)
    (out / name.parent).mkdir(exist_ok=True)
    side = f"{name.stem}.tensors.safetensors"
    os.replace(temporary / side, out / name.parent / side)
    os.replace(path, out / name)
    temporary.rmdir()


def leftovers(out: Path) -> list[Path]:
    """What a killed run can leave besides whole graphs: its temporary directory and index files."""
    return [p for p in out.iterdir() if p.name == ".tmp" or p.name.startswith(f".{INDEX}.")]


class GraphStore:
    """A graph store on disk (see the module docstring): its index, and each graph read on demand."""

    def __init__(self, path: "str | os.PathLike"):
        self.path = Path(path)
        if not (self.path / INDEX).is_file():
            raise ValueError(f"{self.path} holds no graph store ({INDEX} missing): write one with attribute_dataset")
        self.index = json.loads((self.path / INDEX).read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{self.path / INDEX} is format {self.index.get('format')!r}, not {FORMAT!r}")
        n = len(self.index["prompts"])
        done = set(self.index["done"])
        if len(done) < n:
            raise ValueError(f"the store in {self.path} is incomplete: {n - len(done)} of {n} graphs not written; "
                             "rerun attribute_dataset on it to finish")
        for i in range(n):
            if not self.file(i).is_file() or not self.file(i).with_name(f"{self.file(i).stem}.tensors.safetensors").is_file():
                raise ValueError(f"graph {i} ({graph_file(i)}) that {INDEX} records is missing from {self.path}; "
                                 "rerun attribute_dataset on this store to compute it again")

    def __len__(self) -> int:
        return len(self.index["prompts"])

    @property
    def entries(self) -> list[dict]:
        """Each graph's prompt as the index records it: text (or None), tokens, target, length."""
        return self.index["prompts"]

    @property
    def settings(self) -> dict:
        """The options every graph was computed with (`attribute`'s)."""
        return self.index["settings"]

    def file(self, i: int) -> Path:
        if not 0 <= i < len(self):
            raise IndexError(f"graph {i} of a store of {len(self)}")
        return self.path / graph_file(i)

    def __getitem__(self, i: int) -> AttributionGraph:
        return AttributionGraph.from_json(self.file(i))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def graph_json(self, i: int) -> dict:
        """Graph i's file as written: circuit-tracer's schema, its pruned nodes and links."""
        return json.loads(self.file(i).read_text())

    def check(self, model=None, transcoders=None) -> None:
        """Refuse (one line) if the store was written by another model or other transcoders than these."""
        from hooked_models.corpus.source import model_identity

        for what, given, identity in (("model", model, model_identity), ("transcoders", transcoders,
                                                                          transcoders_identity)):
            if given is not None and identity(given) != self.index[what]:
                raise ValueError(f"the store in {self.path} was written by another {what} than the one given "
                                 f"({what} identity differs: {', '.join(k for k, v in identity(given).items() if self.index[what].get(k) != v)})")

    def __repr__(self) -> str:
        return f"GraphStore({str(self.path)!r}: {len(self)} graphs of {self.index['model']['family']})"
