"""A harvest's directory: the staged token windows, the shard files, the manifest that records the
shards done (so a rerun resumes), the lock that keeps one harvest per directory, and the `datasets` files
written when the last shard is in."""

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from hooked_models.corpus.data import require_datasets

MANIFEST = "manifest.json"
WINDOWS = "windows.int32"
SHARD_FILE = "data-{shard:05d}.arrow"
FORMAT = "hooked_models.corpus.harvest/1"


def stage_windows(batches: Iterator[np.ndarray], model, path: Path) -> int:
    """Write the windows as int32 rows to `path` (renamed into place when whole); returns their count."""
    rows, vocab = 0, model.cfg.vocab_size
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        for batch in batches:
            if batch.size and (batch.min() < 0 or batch.max() >= vocab):
                bad = int(batch.min()) if batch.min() < 0 else int(batch.max())
                raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
            f.write(np.ascontiguousarray(batch, dtype=np.int32).tobytes())
            rows += len(batch)
    if rows == 0:
        raise ValueError("the dataset gives no window (text shorter than one context_size?)")
    os.replace(partial, path)
    return rows


def read_windows(path: Path, start: int, stop: int, context_size: int) -> np.ndarray:
    """Rows [start, stop) of a staged windows file, read (not memory-mapped: memory stays one shard)."""
    with open(path, "rb") as f:
        f.seek(start * context_size * 4)
        return np.fromfile(f, dtype=np.int32, count=(stop - start) * context_size).reshape(-1, context_size)


def shard_file(shard: int) -> str:
    return SHARD_FILE.format(shard=shard)


class Manifest:
    """out/manifest.json: the harvest's identity (model, corpus, names, dtype, sizes) and the shards done,
    rewritten whole (temporary name, then renamed) after each change.

    The shards done are kept as runs of consecutive shards with their rows (`{"shards": [0, 40], "rows":
    [0, 2560]}`: shards 0-39 hold rows 0-2559, in files data-00000.arrow ...), so the manifest stays a few
    lines however many shards a corpus has (workers finish them nearly in order)."""

    def __init__(self, out: Path):
        self.path = out / MANIFEST
        self.data: dict = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.runs = [run["shards"] for run in self.data.get("shards", [])]
        self.done = {shard for a, b in self.runs for shard in range(a, b)}

    def record(self, shard: int, plan) -> None:
        """Shard `shard` of `plan` (a HarvestPlan) is written."""
        self.done.add(shard)
        merged: list[list[int]] = []
        for a, b in sorted([*self.runs, [shard, shard + 1]]):  # a few runs: as many as workers, roughly
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.runs = merged
        self.data["shards"] = [{"shards": [a, b], "rows": [plan.shard_rows(a)[0], plan.shard_rows(b - 1)[1]]}
                               for a, b in merged]
        self.save()

    def save(self) -> None:
        partial = self.path.with_name(f".{MANIFEST}.{uuid.uuid4().hex}")
        partial.write_text(json.dumps(self.data, indent=1))
        os.replace(partial, self.path)


# The fields of a manifest that must match for a harvest to continue it.
IDENTITY = ("format", "names", "dtype", "storage_dtype", "context_size", "batch_size", "shard_size", "model",
            "dataset")


def refuse_mismatch(existing: dict, job: dict, out: Path) -> None:
    for key in IDENTITY:
        if key == "dataset":
            continue  # compared once the corpus is read
        if existing.get(key) != job.get(key):
            if key == "model":
                which = [k for k in job["model"] if existing.get("model", {}).get(k) != job["model"][k]]
                detail = f"its {' and '.join(which)} differ"
            else:
                detail = f"{existing.get(key)!r} there, {job.get(key)!r} now"
            raise ValueError(f"{out} holds a harvest of another job ({key}: {detail}); it is never mixed with "
                             "this one: harvest into another directory, or delete it to start over")


def leftovers(out: Path) -> list[Path]:
    """What a killed harvest can leave besides its results: the lock file, the staging directory of
    partial shards, and the temporary files that manifest, windows and state are written to before
    they are renamed into place."""
    return [p for p in out.iterdir()
            if p.name in (".lock", ".tmp") or p.name.startswith(f".{MANIFEST}.") or p.name.endswith(".partial")]


def check_out(out: Path, resume: bool, ignored: list[Path], marker: str, what: str) -> None:
    """Refuse an `out` that is a file, or that holds anything but `ignored` (a killed run's temporaries) and
    is not a `what` (no `marker` file in it), or that is not empty when `resume` is False."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is a file, not a directory")
    if out.is_dir() and set(out.iterdir()) - set(ignored):
        if not resume:
            raise ValueError(f"out={str(out)!r} is not empty; pass resume=True to continue the {what} there, "
                             "or give an empty directory")
        if not (out / marker).exists():
            raise ValueError(f"out={str(out)!r} is not empty and holds no {what} ({marker}); "
                             "give an empty directory")


def clear_leftovers(out: Path) -> None:
    """Delete a killed harvest's temporaries (the lock held, so no other harvest is writing them)."""
    for path in leftovers(out):
        if path.name == ".tmp":
            shutil.rmtree(path, ignore_errors=True)
        elif path.name != ".lock":
            path.unlink(missing_ok=True)


class HarvestInProgress(RuntimeError):
    """Another harvest holds the directory's lock."""


@contextmanager
def locked(out: Path, what: str = "harvest"):
    """One run at a time per directory (a killed one leaves no lock: the kernel drops it); `what` names
    the kind of run in the refusal."""
    with open(out / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise HarvestInProgress(f"another {what} is writing to {out}; wait for it to finish, or write "
                                    "into another directory") from None
        yield


def finish(out: Path, manifest: Manifest, plan) -> None:
    """Write `datasets`' dataset_info.json and state.json over the shards of `plan` (a HarvestPlan), in
    order, and drop the staging."""
    datasets = require_datasets()
    missing = [s for s in range(plan.shards) if s not in manifest.done or not (out / shard_file(s)).exists()]
    if missing:
        raise RuntimeError(f"shards {missing[:10]} of {out} are missing after the run")
    datasets.DatasetInfo(features=plan.features).write_to_directory(str(out))
    files = [shard_file(s) for s in range(plan.shards)]
    state = {"_data_files": [{"filename": f} for f in files],
             # A fingerprint from the content's identity, so the same harvest gives the same bytes.
             "_fingerprint": hashlib.sha256(json.dumps([manifest.data[k] for k in IDENTITY]).encode()).hexdigest()[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    partial = out / ".state.json.partial"
    partial.write_text(json.dumps(state, indent=2, sort_keys=True))
    os.replace(partial, out / "state.json")
    manifest.data["complete"] = True
    manifest.save()
    (out / WINDOWS).unlink(missing_ok=True)
    shutil.rmtree(out / ".tmp", ignore_errors=True)
