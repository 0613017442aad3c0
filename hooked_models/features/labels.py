"""A label per feature: a heuristic one from its statistics, and the user's own, which win.

The heuristic label names what a reader would look at first: the tokens where the feature peaks in its
top windows (the most frequent first) and the tokens its decoder direction promotes through the
unembedding, as `"Mary, Nora | → Mary"`. It is only that, a heuristic, and the files say so
(`HEURISTIC`). A user's labels come as JSON (a list of {"layer", "feature", "label"}) or CSV (a header
`layer,feature,label`), and replace the heuristic one of each feature they name.
"""

import csv
import json
import os
from collections import Counter
from pathlib import Path

from hooked_models.features.results import FeatureStatistics, LayerStatistics

HEURISTIC = "heuristic: the tokens at its top windows' peaks | → the tokens its decoder promotes"
USER = "user"


def _shown(token: str) -> str:
    """A token as a label shows it: stripped, quoted when it has no letter or digit (`","`, `" "`)."""
    stripped = token.strip()
    return stripped if any(c.isalnum() for c in stripped) else f'"{stripped or token}"'


def heuristic_label(layer: LayerStatistics, feature: int, n: int = 2) -> str:
    """`"peak, peak | → promoted, promoted"`; "never active" for a feature that never fired."""
    windows = layer.top_windows(feature)
    if not windows:
        return "never active"
    peaks = Counter(_shown(w.tokens[w.position - w.start]) for w in windows)
    label = ", ".join(token for token, _ in peaks.most_common(n))  # ties keep the strongest window's first
    promoted = [_shown(layer.token_strings.get(int(t), str(int(t)))) for t in layer.top_logits[feature, :n].tolist()]
    return f"{label} | → {', '.join(promoted)}" if promoted else label


def read_user_labels(path: str | os.PathLike) -> dict[tuple[int | None, int], str]:
    """{(layer, feature): label} from a JSON or CSV file (see the module docstring). A layer left empty
    (or null) is an SAE's, which has none; a feature that is not an integer, or a row without a label,
    is a ValueError naming the row."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = {"layer", "feature", "label"} - set(reader.fieldnames or [])
            if missing:
                raise ValueError(f"{path} lacks the column(s) {sorted(missing)}: its header must be layer,feature,label")
            rows = [(f"line {reader.line_num}", row) for row in reader]
    else:
        entries = json.loads(path.read_text())
        if not isinstance(entries, list) or not all(isinstance(r, dict) and {"layer", "feature", "label"} <= set(r)
                                                     for r in entries):
            raise ValueError(f"{path} must hold a list of {{\"layer\", \"feature\", \"label\"}} objects")
        rows = [(f"entry {i}", row) for i, row in enumerate(entries)]
    out = {}
    for where, row in rows:
        layer = None if row["layer"] in (None, "") else _integer(row["layer"], "layer", f"{path}, {where}")
        feature = _integer(row["feature"], "feature", f"{path}, {where}")
        label = row["label"]
        if not isinstance(label, str):  # a CSV row short of its label reads None, as JSON's null does
            raise ValueError(f"{path}, {where}: the label of layer={layer}, feature={feature} is {label!r}, "
                             "not a string")
        out[(layer, feature)] = label
    return out


def _integer(value, name: str, where: str) -> int:
    """`value` as an integer: an int, an integral float (2.0) or a string of one ("2"); never a bool,
    never rounded (2.7 is refused, not read as 2)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{where}: {name}={value!r} is not an integer")


def labels(stats: FeatureStatistics, user: str | os.PathLike | dict | None = None) -> dict[tuple[int | None, int], tuple[str, str]]:
    """{(layer, feature): (label, source)} for every feature, source `HEURISTIC` or `USER`; a user label
    for a layer or feature the statistics do not hold is a ValueError naming it."""
    mine = {} if user is None else (dict(user) if isinstance(user, dict) else read_user_labels(user))
    out = {}
    for layer in stats.layers:
        for f in range(layer.d_sae):
            out[(layer.layer, f)] = (heuristic_label(layer, f), HEURISTIC)
    for (layer, feature), label in mine.items():
        if (layer, feature) not in out:
            held = [(layer.layer, layer.d_sae) for layer in stats.layers]
            raise ValueError(f"a user label names layer={layer}, feature={feature}; the statistics hold (layer, "
                             f"number of features) {held}")
        out[(layer, feature)] = (label, USER)
    return out
