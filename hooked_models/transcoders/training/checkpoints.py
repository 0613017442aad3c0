"""Checkpoints per shard: `DIR/step-{n}/rank-{r}-of-{N}.pt` (this process's parameters, optimizer state,
dead-feature counters, data stream and curves), and `DIR/latest.json` naming the last step every process
finished writing. A process killed at any moment leaves the previous complete checkpoint, which a rerun
resumes from; the rerun ends with the uninterrupted run's weights."""

import json
import os
import shutil
from pathlib import Path

import torch

from hooked_models.transcoders.training.distributed import Layout


def _rank_file(directory: Path, step: int, layout: Layout) -> Path:
    return directory / f"step-{step:08d}" / f"rank-{layout.rank}-of-{layout.world}.pt"


def save(directory: str | os.PathLike, step: int, state: dict, job: dict, layout: Layout) -> None:
    """Every process writes its file; once all have, process 0 names the step in latest.json (written under a
    temporary name and renamed into place) and removes older steps."""
    directory = Path(directory)
    file = _rank_file(directory, step, layout)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, file)
    layout.barrier()
    if layout.rank == 0:
        latest = directory / "latest.json"
        tmp = directory / "latest.json.tmp"
        tmp.write_text(json.dumps({"step": step, "processes": layout.world, "job": job}, indent=1))
        os.replace(tmp, latest)
        for old in directory.glob("step-*"):
            if old.is_dir() and old.name != file.parent.name:
                shutil.rmtree(old, ignore_errors=True)
    layout.barrier()


def load(directory: str | os.PathLike, job: dict, layout: Layout) -> tuple[int, dict] | None:
    """(step, this process's state) of the last complete checkpoint, or None where there is none; one of
    another training run or process count is refused by name."""
    directory = Path(directory)
    latest = directory / "latest.json"
    if not latest.is_file():
        return None
    saved = json.loads(latest.read_text())
    if saved["processes"] != layout.world:
        raise ValueError(f"checkpoint {directory} was written by {saved['processes']} processes; this run has "
                         f"{layout.world}: resume with {saved['processes']}")
    theirs = saved["job"]
    for key, mine in job.items():
        if theirs.get(key) != mine:
            raise ValueError(f"checkpoint {directory} is of another training run: its {key} is {theirs.get(key)}, "
                             f"this run's {mine}")
    step = int(saved["step"])
    return step, torch.load(_rank_file(directory, step, layout), weights_only=True)
