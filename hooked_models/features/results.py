"""A statistics result: every feature of every layer, read feature by feature, saved and loaded.

`FeatureStatistics` holds one `LayerStatistics` per SAE (or per layer of a transcoder set): the merged
`Partial` of the whole corpus and each feature's top and bottom logits. It is what the exporters
(circuit-tracer's feature files, Neuronpedia's bulk layout) write, what the labels read, and what the
explorer opens; `save(dir)` writes `statistics.json` and `statistics.safetensors`, `load(dir)` reads them.
"""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from jaxtyping import Float, Int
from safetensors.torch import load_file, save_file
from torch import Tensor

from hooked_models.features.partial import NEVER, Limits, Partial

FORMAT = "hooked_models.features.statistics/1"
META, TENSORS = "statistics.json", "statistics.safetensors"


@dataclass
class Window:
    """A stretch of one corpus window around one of its tokens (a feature's peak, or a sampled token)."""

    row: int  # the window's index in the corpus (the harvest's row)
    position: int  # the token's position in the row
    start: int  # the first position shown
    tokens: list[str]
    activations: list[float]  # the feature's activation at each token shown

    @property
    def peak(self) -> float:
        return self.activations[self.position - self.start]


@dataclass
class LayerStatistics:
    """Every feature of one SAE or transcoder layer over the corpus. `name` is the value it reads (the
    harvest column), `layer` its layer (None for an SAE that names none), `transcoder_id` how files name
    it. Logits: each feature's decoder direction through the unembedding (W_dec[f] @ W_U), the
    `top_logits`/`bottom_logits` token ids [d_sae n] with their weights, empty with `logit_note` saying why."""

    name: str
    layer: int | None
    transcoder_id: str
    partial: Partial
    top_logits: Int[Tensor, "d_sae n"]
    top_values: Float[Tensor, "d_sae n"]
    bottom_logits: Int[Tensor, "d_sae n"]
    bottom_values: Float[Tensor, "d_sae n"]
    logit_note: str = ""

    d_sae = property(lambda self: self.partial.limits.d_sae)

    def frequency(self) -> Float[Tensor, " d_sae"]:
        """The fraction of the corpus's tokens where each feature is active (> 0)."""
        return self.partial.active.double() / max(self.partial.tokens, 1)

    def range_top(self, feature: int) -> float:
        """The top of the feature's histogram range [0, 2^e), its largest activation below it (0 if it never fired)."""
        e = int(self.partial.exponent[feature])
        return 0.0 if e == NEVER else 2.0 ** e

    def histogram(self, feature: int) -> tuple[list[int], list[float]]:
        """(counts of the feature's positive activations in equal bins, the bins' edges from 0)."""
        counts = self.partial.histogram[feature].tolist()
        top = self.range_top(feature)
        return counts, [top * i / len(counts) for i in range(len(counts) + 1)]

    def _examples(self, kind: str, feature: int) -> list[tuple[Window, int]]:
        examples = getattr(self.partial, kind)
        which = (examples.feature == feature).nonzero().flatten()
        return [(self._window(examples, int(i)), int(examples.group[i])) for i in which]

    def top_windows(self, feature: int) -> list[Window]:
        """The feature's top windows: one per corpus row, the largest peaks first."""
        return [w for w, _ in self._examples("top", feature)]

    def interval_windows(self, feature: int) -> list[tuple[float, float, list[Window]]]:
        """(low, high, windows) per activation interval [low, high) from the top one down: windows
        sampled uniformly among the tokens where the feature's activation lies there, strongest first."""
        limits, top = self.partial.limits, self.range_top(feature)
        groups: dict[int, list[Window]] = {}
        for window, group in self._examples("samples", feature):
            groups.setdefault(group, []).append(window)
        width = top / limits.intervals
        return [(g * width, (g + 1) * width, sorted(groups[g], key=lambda w: -w.peak))
                for g in sorted(groups, reverse=True)]

    def board(self, feature: int) -> dict:
        """The feature as `features.dashboard`'s fields (what the explorer's features view draws), read from
        these statistics: no pass over the corpus. `mean_active` is None (the statistics keep no float sum)."""
        counts, edges = self.histogram(feature)
        strings = lambda ids: [self.token_strings.get(int(t), str(int(t))) for t in ids]  # noqa: E731
        return {"feature": feature, "name": self.name, "d_sae": self.d_sae, "tokens": self.partial.tokens,
                "density": float(self.frequency()[feature]), "max_activation": max(float(self.partial.act_max[feature]), 0.0),
                "mean_active": None, "windows": [asdict(w) for w in self.top_windows(feature)], "counts": counts,
                "edges": edges, "promoted": list(zip(strings(self.top_logits[feature]), self.top_values[feature].tolist())),
                "suppressed": list(zip(strings(self.bottom_logits[feature]), self.bottom_values[feature].tolist())),
                "logit_note": self.logit_note}

    def _window(self, examples, i: int) -> Window:
        seq, radius = self.context_size, self.partial.limits.radius
        index = int(examples.index[i])
        row, position = divmod(index, seq)
        tokens = examples.tokens[i]
        inside = (tokens >= 0).nonzero().flatten()
        lo, hi = int(inside[0]), int(inside[-1]) + 1
        strings = [self.token_strings.get(int(t), str(int(t))) for t in tokens[lo:hi]]
        return Window(row, position, position - radius + lo, strings, examples.acts[i, lo:hi].tolist())

    # set by FeatureStatistics for its layers
    context_size: int = 0
    token_strings: dict = field(default_factory=dict)


@dataclass
class FeatureStatistics:
    """Statistics of every feature of one or more SAEs or transcoder layers over one corpus."""

    layers: list[LayerStatistics]
    context_size: int
    rows: int
    token_strings: dict[int, str]
    model_name: str = ""
    job: dict = field(default_factory=dict)

    def __post_init__(self):
        for layer in self.layers:
            layer.context_size, layer.token_strings = self.context_size, self.token_strings

    def __getitem__(self, key: int | str) -> LayerStatistics:
        """A layer's statistics by layer number or by the value it reads."""
        for layer in self.layers:
            if key in (layer.layer, layer.name, layer.transcoder_id):
                return layer
        known = [(layer.layer, layer.name) for layer in self.layers]
        raise KeyError(f"no statistics for {key!r}; these hold {known}")

    def __len__(self) -> int:
        return len(self.layers)

    def save(self, path: str | os.PathLike) -> Path:
        """`path/statistics.json` and `path/statistics.safetensors` (the tensors written first, the JSON,
        which `load` opens first, renamed into place last: a half-written result is never read)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, layer in enumerate(self.layers):
            tensors.update(layer.partial.tensors(f"{i}."))
            for name in ("top_logits", "top_values", "bottom_logits", "bottom_values"):
                tensors[f"{i}.{name}"] = getattr(layer, name).contiguous()
        save_file(tensors, str(path / TENSORS))
        meta = {"format": FORMAT, "context_size": self.context_size, "rows": self.rows, "model_name": self.model_name,
                "job": self.job, "token_strings": {str(k): v for k, v in sorted(self.token_strings.items())},
                "layers": [{"name": layer.name, "layer": layer.layer, "transcoder_id": layer.transcoder_id,
                            "logit_note": layer.logit_note, "limits": asdict(layer.partial.limits)}
                           for layer in self.layers]}
        partial = path / (META + ".partial")
        partial.write_text(json.dumps(meta))
        os.replace(partial, path / META)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FeatureStatistics":
        path = Path(path)
        if not (path / META).is_file():
            raise FileNotFoundError(f"no {META} in {path}: not a features.statistics result")
        meta = json.loads((path / META).read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path / META} is format {meta.get('format')!r}, not {FORMAT!r}")
        tensors = load_file(str(path / TENSORS))
        layers = []
        for i, info in enumerate(meta["layers"]):
            limits = Limits(**info["limits"])
            layers.append(LayerStatistics(info["name"], info["layer"], info["transcoder_id"],
                                          Partial.from_tensors(limits, tensors, f"{i}."),
                                          *(tensors[f"{i}.{n}"] for n in ("top_logits", "top_values",
                                                                         "bottom_logits", "bottom_values")),
                                          info["logit_note"]))
        return cls(layers, meta["context_size"], meta["rows"], {int(k): v for k, v in meta["token_strings"].items()},
                   meta["model_name"], meta["job"])
