"""Labels: the heuristic one against its definition computed here from the windows and logits, user labels
(CSV and JSON) winning over it, and bad label files as clear errors."""

import json
import re
from collections import Counter

import pytest

from hooked_models import features
from hooked_models.features.labels import HEURISTIC, USER, labels

from ..explorer.conftest import ReluSAE, alpha_er, arcee, data_dir, real_graph, sae, transcoders  # noqa: F401


@pytest.fixture(scope="module")
def stats(arcee, data_dir, transcoders):
    return features.statistics(data_dir / "acts", transcoders, model=arcee, k=5, radius=2, progress=False)


def shown(token):
    s = token.strip()
    return s if any(c.isalnum() for c in s) else f'"{s or token}"'


def test_the_heuristic_label_is_the_peaks_and_the_promoted_tokens(stats, arcee):
    named = labels(stats)
    assert len(named) == 2 * 8
    for (layer, feature), (label, source) in named.items():
        windows = stats[layer].top_windows(feature)
        peaks = [shown(w.tokens[w.position - w.start]) for w in windows]
        first = sorted(Counter(peaks).items(), key=lambda kv: (-kv[1], peaks.index(kv[0])))[:2]
        promoted = [shown(t) for t in arcee.to_str_tokens(stats[layer].top_logits[feature, :2])]
        expected = (f"{', '.join(t for t, _ in first)} | → {', '.join(promoted)}" if windows else "never active")
        assert (label, source) == (expected, HEURISTIC)


def test_user_labels_win(stats, tmp_path):
    (tmp_path / "mine.csv").write_text("layer,feature,label\n1,3,names\n0,7,the end\n")
    (tmp_path / "mine.json").write_text(json.dumps([{"layer": 1, "feature": 3, "label": "names"}]))
    from_csv, from_json, plain = labels(stats, tmp_path / "mine.csv"), labels(stats, tmp_path / "mine.json"), labels(stats)
    assert from_csv[(1, 3)] == ("names", USER) == from_json[(1, 3)] and from_csv[(0, 7)] == ("the end", USER)
    assert {k: v for k, v in from_csv.items() if k not in ((1, 3), (0, 7))} == {
        k: v for k, v in plain.items() if k not in ((1, 3), (0, 7))}


def test_bad_label_files_are_clear_errors(stats, tmp_path):
    (tmp_path / "a.csv").write_text("layer,index,label\n1,3,x\n")
    with pytest.raises(ValueError, match=r"lacks the column\(s\) \['feature'\]"):
        labels(stats, tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("layer,feature,label\n1,8,x\n")
    with pytest.raises(ValueError, match=r"names layer=1, feature=8; the statistics hold .* \[\(0, 8\), \(1, 8\)\]"):
        labels(stats, tmp_path / "b.csv")
    (tmp_path / "c.json").write_text(json.dumps({"layer": 1}))
    with pytest.raises(ValueError, match="must hold a list"):
        labels(stats, tmp_path / "c.json")


BAD_ROWS = [
    ("null.json", json.dumps([{"layer": 1, "feature": None, "label": "x"}]),
     r"entry 0: feature=None is not an integer"),
    ("float.json", json.dumps([{"layer": 0, "feature": 1, "label": "a"}, {"layer": 1, "feature": 2.7, "label": "x"}]),
     r"entry 1: feature=2\.7 is not an integer"),
    ("true.json", json.dumps([{"layer": True, "feature": 1, "label": "x"}]), r"entry 0: layer=True is not an integer"),
    ("nolabel.json", json.dumps([{"layer": 1, "feature": 2, "label": None}]),
     r"entry 0: the label of layer=1, feature=2 is None, not a string"),
    ("short.csv", "layer,feature,label\n1,3,names\n0,7\n", r"line 3: the label of layer=0, feature=7 is None"),
    ("float.csv", "layer,feature,label\n1,2.7,x\n", r"line 2: feature='2\.7' is not an integer"),
]


@pytest.mark.parametrize("name, text, message", BAD_ROWS, ids=[row[0] for row in BAD_ROWS])
def test_a_bad_row_is_an_error_naming_it(stats, tmp_path, name, text, message):
    """A JSON null feature (was a TypeError), 2.7 (was read as 2), a bool, a row without a label (was
    the label "None"): each a one-line ValueError naming the file and the row."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / name))}, {message}"):
        labels(stats, tmp_path / name)


def test_integral_numbers_and_an_empty_layer_are_read(tmp_path):
    from hooked_models.features.labels import read_user_labels

    (tmp_path / "ok.json").write_text(json.dumps([{"layer": 1.0, "feature": "3", "label": ""},
                                                  {"layer": None, "feature": 4, "label": "sae"}]))
    assert read_user_labels(tmp_path / "ok.json") == {(1, 3): "", (None, 4): "sae"}
