"""A subgraph in a graph file: the file's `qParams`, as circuit-tracer's viewer reads and saves them
(`frontend/graph_models.py`'s QParams; `frontend/assets/attribution_graph/init-cg.js` reads them,
`local_server.py`'s `/save_graph` writes them back into the graph file) and Neuronpedia uploads them:

    "qParams": {"pinnedIds": ["1_37_15", "E_523_3", ...],
                "supernodes": [["say Mary", "1_37_15", "1_12_15"], ...],     # [name, *node ids]
                "linkType": "both", "clickedId": "", "sg_pos": "",
                "clerps": "[[\\"902\\",\\"says a name\\"]]"}                  # the viewer's labels

`clerps` is a JSON string (the viewer `JSON.parse`s it) of [feature, label] pairs keyed by a node's
`feature` field, for a transcoder feature Cantor's pairing of its layer and index (`cantor`). Pure JSON
in and out; `subgraph.Subgraph` builds on it.
"""

import json
import math
import os
from pathlib import Path


def cantor(layer: int, feature: int) -> int:
    """The viewer's feature number of (layer, index) (circuit-tracer's `cantor_pairing`)."""
    return (layer + feature) * (layer + feature + 1) // 2 + feature


def uncantor(number: int) -> tuple[int, int]:
    """(layer, index) of a feature number (`cantor`'s inverse, in integers)."""
    w = (math.isqrt(8 * number + 1) - 1) // 2
    feature = number - w * (w + 1) // 2
    return w - feature, feature


def qparams(view: dict, pinned: list[str], supernodes: list[list[str]], clerps: list[list[str]]) -> dict:
    """`view`'s keys in their order with pinnedIds, supernodes and clerps set (missing ones appended;
    clerps only where there are labels or the view had the key)."""
    out = dict(view)
    out["pinnedIds"], out["supernodes"] = pinned, supernodes
    if clerps or "clerps" in out:
        # As the viewer's JSON.stringify writes it: no spaces, characters unescaped.
        out["clerps"] = json.dumps(clerps, separators=(",", ":"), ensure_ascii=False)
    return out


def parse(qparams: dict) -> tuple[list[str], list[tuple[str, list[str]]], list[list[str]]]:
    """(pinned ids, (name, ids) per supernode, [feature, label] pairs) of a viewer's qParams. Names that
    repeat get " (2)", " (3)", ... as circuit-tracer's `decode_url_features` gives them."""
    pinned = qparams.get("pinnedIds") or []
    if isinstance(pinned, str):  # a URL's form, comma-separated (the viewer splits it the same way)
        pinned = pinned.split(",") if pinned else []
    entries = qparams.get("supernodes") or []
    if isinstance(entries, str):
        # The viewer's Save button sends its URL's parameters, where supernodes is JSON.stringify'd
        # (init-cg-subgraph.js's supernodesToUrl), and /save_graph writes that string as it came.
        try:
            entries = json.loads(entries)
        except json.JSONDecodeError:
            raise ValueError(f"supernodes {entries[:60]!r} is neither a list nor the JSON of one") from None
    supernodes, counts = [], {}
    for entry in entries:
        if not isinstance(entry, list) or not entry or not all(isinstance(x, str) for x in entry):
            raise ValueError(f"supernode {entry!r} must be a list of strings, [name, *node ids]")
        name = entry[0]
        counts[name] = counts.get(name, 0) + 1
        supernodes.append((name if counts[name] == 1 else f"{name} ({counts[name]})", entry[1:]))
    clerps = qparams.get("clerps") or []
    if isinstance(clerps, str):
        clerps = json.loads(clerps)
    return list(pinned), supernodes, [list(pair) for pair in clerps]


def read(path: "str | os.PathLike", expected: dict) -> dict:
    """The qParams of `path`'s graph file, checked to be of the graph `expected` describes (metadata
    fields: scan, prompt, prompt_tokens, and slug when given)."""
    data = _graph_file(path)
    check(path, data, expected)
    return data.get("qParams") or {}


def write(path: "str | os.PathLike", qparams: dict, expected: dict) -> None:
    """Set `path`'s graph file's qParams (checked to be of the graph `expected` describes), everything
    else as it was: written back compact, or indented by 2 where the file was (as the viewer saves)."""
    path = Path(path)
    data = _graph_file(path)
    check(path, data, expected)
    indent = 2 if path.read_text()[:2] == "{\n" else None
    data["qParams"] = qparams
    path.write_text(json.dumps(data, indent=indent))


def check(path, data: dict, expected: dict) -> None:
    metadata = data.get("metadata") or {}
    for key, value in expected.items():
        if metadata.get(key) != value:
            raise ValueError(f"{path} is the graph file of another graph: its {key} is {metadata.get(key)!r}, "
                             f"this graph's {value!r}")


def _graph_file(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file: a subgraph is saved into its graph's file (graph.to_json first)")
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "metadata" not in data or "nodes" not in data:
        raise ValueError(f"{path} is not a graph file (no metadata and nodes)")
    return data
