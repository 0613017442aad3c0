"""The report: training.json holds the config and the curves, training.png is drawn, and drawing it leaves the
caller's matplotlib as it was (a notebook's inline backend keeps showing its figures)."""

import json

import matplotlib
import matplotlib.pyplot as plt
from PIL import Image

from hooked_models.transcoders import ModelIdentity, TrainingConfig, TranscoderSet, new_transcoders
from hooked_models.transcoders.training.report import write_report


def test_the_report_is_written_and_leaves_the_backend_and_figures_alone(arcee, tmp_path):
    config = TrainingConfig(d_transcoder=8, activation="topk", k=2, steps=2, log_every=1)
    identity = ModelIdentity.of(arcee)
    tcs = TranscoderSet(list(new_transcoders(identity, config).values()), identity=identity)
    curves = [{"tokens": 1024 * s, "fvu": [0.5 / s, 0.4 / s], "l0": [2.0, 2.0], "dead_pct": [0.0, 12.5],
               "auxk": 0.0} for s in (1, 2)]
    backend = matplotlib.get_backend()
    plt.switch_backend("svg")  # a backend other than Agg stands for a notebook's inline one
    before = plt.get_fignums()  # figures other tests left open stay as they are too
    try:
        mine = plt.figure()
        write_report(tmp_path, tcs, config, curves, {"processes": 1})
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [*before, mine.number]
    finally:
        plt.close(mine)
        plt.switch_backend(backend)
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["config"]["k"] == 2 and report["curves"] == curves and report["final"] == curves[-1]
    assert Image.open(tmp_path / "training.png").size == (1430, 396)  # 13 x 3.6 inches at 110 dpi
