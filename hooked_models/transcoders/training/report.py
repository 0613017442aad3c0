"""What a training run leaves beside its transcoders: `training.json` (the config, the run, the curves) and
`training.png` (FVU, L0 and dead % per layer against tokens seen); `read_result` reads it all back."""

import json
import os
from dataclasses import asdict
from pathlib import Path

from hooked_models.transcoders.training.config import TrainingConfig


def write_report(out: str | os.PathLike, transcoders, config: TrainingConfig, curves: list[dict], run: dict,
                 evaluation: dict | None = None) -> Path:
    """Save `transcoders` to `out` (circuit-tracer's layout; {layer: Transcoder} as `layer_{l}.safetensors`
    files) with training.json (and `evaluation`, where measured) and training.png beside them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(transcoders, dict):  # some layers: each layer's file, which a later run's set can list
        from safetensors.torch import save_file

        for layer, tc in transcoders.items():
            save_file(tc.state_for_file(), str(out / f"layer_{layer}.safetensors"))
    else:
        transcoders.save(out)
    final = curves[-1] if curves else {}
    report = {"config": asdict(config), "run": run, "final": final, "evaluation": evaluation, "curves": curves}
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_curves(curves, out / "training.png", run.get("layers"))
    return out


def read_result(out: str | os.PathLike):
    """What `write_report` saved in `out`, as `train_transcoders` returned it: a `TranscoderSet` or
    `CrossLayerTranscoder` (`load_transcoders`), or {layer: Transcoder} for a run of some layers."""
    from safetensors.torch import load_file

    from hooked_models.transcoders.loading import load_transcoders
    from hooked_models.transcoders.single_layer_transcoder import Transcoder

    out = Path(out)
    layers = json.loads((out / "training.json").read_text())["config"]["layers"]
    if layers is None:
        return load_transcoders(out)
    return {l: Transcoder.from_file_state(load_file(str(out / f"layer_{l}.safetensors")), l) for l in layers}


def plot_curves(curves: list[dict], path: Path, names: list[int] | None = None) -> None:
    """Three panels against tokens seen: each layer's FVU (log scale), L0 and dead % (layers `names`)."""
    # A Figure without pyplot: no backend switched, no figure left open (a notebook keeps drawing inline).
    try:
        from matplotlib.figure import Figure
    except ImportError:  # the transcoders and training.json are written already
        raise ImportError(f"drawing {path.name} needs matplotlib: pip install 'hooked_models[train]' (the "
                          "transcoders and training.json are written)") from None

    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    tokens = [c["tokens"] for c in curves]
    names = names or list(range(len(curves[0]["fvu"]) if curves else 0))
    for key, ax, title in (("fvu", axes[0], "FVU (training batch)"), ("l0", axes[1], "L0"),
                           ("dead_pct", axes[2], "dead %")):
        layers = len(curves[0][key]) if curves else 0
        for l in range(layers):
            ax.plot(tokens, [c[key][l] for c in curves], label=f"layer {names[l]}" if layers <= 12 else None, lw=1)
        ax.set_title(title)
        ax.set_xlabel("tokens")
        if key == "fvu":
            ax.set_yscale("log")
    if curves and len(curves[0]["fvu"]) <= 12:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
