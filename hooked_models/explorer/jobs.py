"""The explorer's background jobs: a visible queue, real progress, cancellation, and views that never wait.

Design. Hooks are state on the model's HookPoints, so two runs hooking one model at once would see each
other's hooks. The views (prompt, attention, an edge's patch) and the jobs (patching sweeps, circuits,
feature passes) therefore run on two models that share every parameter and buffer, storage and all:
`replica(model)` is a deep copy whose memo maps each tensor to itself, so it has its own modules and
HookPoints (its own hooks) and no second copy of the weights (none is affordable at AFM-4.5B's size).
Nothing here writes a weight, so both stay bit-identical to the model the server was given.

- Jobs run one at a time, in order, on one worker thread over the replica; queued jobs show their place.
- Views run on the model itself, one at a time (`views`, a lock: a view is one forward or two).
- Both share torch's intra-op thread pool. While a view runs, the job steps aside at its next batch
  boundary (its progress callable waits), so a view gets the machine's threads and answers within a
  batch's time, however long the job. The job waits only for the views already there when it stepped
  aside, so views arriving without pause cannot starve it: it takes a batch per round of them.
- Progress is `hooked_models.progress`'s: the job's `report` is the `progress=` callable the library's long
  functions take (a `Step` after every batch; a bare fraction from the ones that still report that).
  Cancelling sets a flag that `report` turns into `Cancelled` at the next batch: the function's hooks come
  off as on any exception, and the job ends "cancelled". A queued job is cancelled before it starts.
- `shutdown` cancels everything and waits for the worker at most a moment (the worker is a daemon
  thread, so a stop never waits for a job to finish on its own).
"""

import copy
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.nn as nn

from hooked_models.progress import Cancelled, Step

FINISHED = ("done", "error", "cancelled")


def replica(model: nn.Module) -> nn.Module:
    """A copy of `model` with its own modules and HookPoints over the same parameters, buffers and
    tokenizer (the same tensor objects: no weight is copied)."""
    shared = [*model.parameters(), *model.buffers()]
    memo = {id(tensor): tensor for tensor in shared}
    if getattr(model, "tokenizer", None) is not None:
        memo[id(model.tokenizer)] = model.tokenizer
    return copy.deepcopy(model, memo)


def message(error: Exception) -> str:
    """The user's message for an exception: its text (a KeyError's without the quotes repr adds)."""
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    return str(error) or type(error).__name__


@dataclass
class Job:
    """A background computation: `state` queued → running → done | error | cancelled; `progress` the
    fraction done where the function reports it (None: not yet known), `done`/`total` in `unit`s and
    `phase` as its last `Step` said; `result` the JSON it returned, `error` the message it raised."""

    id: str
    kind: str
    work: Callable = field(repr=False)
    state: str = "queued"
    progress: float | None = None
    done: int | None = None
    total: int | None = None
    unit: str | None = None
    phase: str | None = None
    submitted: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    result: object = None
    error: str | None = None
    cancel_requested: bool = False
    queue: "Jobs | None" = field(default=None, repr=False)

    def report(self, step: Step | float) -> None:
        """The `progress=` callable: record where the work stands; stop it (`Cancelled`) if asked to; wait
        here while a view runs."""
        if isinstance(step, Step):
            self.progress, self.done, self.total, self.unit, self.phase = (
                step.fraction, step.done, step.total, step.unit, step.phase)
        else:
            self.progress = float(step)
        if self.queue is not None:
            self.queue.step_aside(self)  # returns at once when no view runs, or when the job is cancelled
        if self.cancel_requested:
            raise Cancelled(f"job {self.id} was cancelled")

    def status(self, place: int | None = None) -> dict:
        now = self.finished or time.time()
        fields = ("id", "kind", "state", "progress", "done", "total", "unit", "phase", "result", "error",
                  "cancel_requested")
        return {**{name: getattr(self, name) for name in fields}, "place": place,
                "elapsed": now - (self.started or self.submitted), "waited": (self.started or now) - self.submitted}


class Jobs:
    """The queue over `model`'s replica: `submit(kind, work)` with `work(model, job)` run on the replica,
    `get`, `cancel`, `listing`, and `views()`, the context the interactive requests run in."""

    def __init__(self, model: nn.Module):
        self.model = replica(model)
        self.jobs: dict[str, Job] = {}
        self.waiting: deque[Job] = deque()
        self.changed = threading.Condition()
        self.view_lock = threading.Lock()
        self.view_tickets: set[int] = set()  # the views entered and not yet finished
        self.next_ticket = 0
        self.stopping = False
        self.worker = threading.Thread(target=self._work, name="explorer-jobs", daemon=True)
        self.worker.start()

    # ---------------------------------------------------------------------------- the queue
    def submit(self, kind: str, work: Callable[[nn.Module, Job], object]) -> dict:
        job = Job(uuid.uuid4().hex[:12], kind, work, queue=self)
        with self.changed:
            if self.stopping:
                raise RuntimeError("the explorer is stopping and takes no new jobs")
            self.jobs[job.id] = job
            self.waiting.append(job)
            self.changed.notify_all()
        return {"job": job.id, "kind": kind, "place": self.place(job)}

    def get(self, job_id: str) -> Job:
        """The job `job_id`; a KeyError naming it if there is none."""
        if job_id not in self.jobs:
            raise KeyError(f"no job {job_id!r}")
        return self.jobs[job_id]

    def place(self, job: Job) -> int | None:
        """How many jobs run or wait before `job` (0: it runs now); None once it has finished."""
        with self.changed:
            if job.state == "running":
                return 0
            if job not in self.waiting:
                return None
            running = any(j.state == "running" for j in self.jobs.values())
            return self.waiting.index(job) + running

    def status(self, job_id: str) -> dict:
        job = self.get(job_id)
        return job.status(self.place(job))

    def listing(self) -> list[dict]:
        """The jobs that run or wait, in order, without their results."""
        with self.changed:
            live = [j for j in self.jobs.values() if j.state == "running"] + list(self.waiting)
        return [{k: v for k, v in j.status(self.place(j)).items() if k != "result"} for j in live]

    def cancel(self, job_id: str) -> dict:
        """Stop `job_id`: a queued job at once, a running one at its next batch. A finished job stays as it was."""
        job = self.get(job_id)
        with self.changed:
            if job in self.waiting:
                self.waiting.remove(job)
                job.state, job.finished = "cancelled", time.time()
            elif job.state == "running":
                job.cancel_requested = True
            self.changed.notify_all()
        return job.status(self.place(job))

    def shutdown(self, timeout: float = 0.25) -> None:
        """Cancel every job and wait for the worker at most `timeout` seconds."""
        with self.changed:
            self.stopping = True
            for job in list(self.waiting) + [j for j in self.jobs.values() if j.state == "running"]:
                self.cancel(job.id)
            self.changed.notify_all()
        self.worker.join(timeout)

    # ---------------------------------------------------------------------------- views first
    @contextmanager
    def views(self):
        """Where an interactive request runs: one at a time on the model, while the job waits at its next
        batch boundary."""
        with self.changed:
            ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
            self.view_tickets.add(ticket)
        try:
            with self.view_lock:
                yield
        finally:
            with self.changed:
                self.view_tickets.discard(ticket)
                self.changed.notify_all()

    def step_aside(self, job: Job) -> None:
        """Called by the running `job` between batches: wait until the views entered before it have
        answered (or it is cancelled). Views that arrive while it waits do not extend the wait, so a
        stream of views that never pauses still lets the job take one batch per round of them."""
        with self.changed:
            ahead = set(self.view_tickets)
            self.changed.wait_for(lambda: not (ahead & self.view_tickets) or self.stopping or job.cancel_requested)

    # ---------------------------------------------------------------------------- the worker
    def _work(self) -> None:
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.waiting or self.stopping)
                if not self.waiting:
                    return
                job = self.waiting.popleft()
                job.state, job.started = "running", time.time()
            self._run(job)

    def _run(self, job: Job) -> None:
        try:
            result = job.work(self.model, job)
            if job.cancel_requested:  # a function that reports no steps cannot stop early: its result is dropped
                raise Cancelled(f"job {job.id} was cancelled")
            job.result, job.progress, job.state = result, 1.0, "done"
        except Cancelled:
            job.state = "cancelled"
        except Exception as error:  # noqa: BLE001 - any failure is the job's message; the server serves on
            job.error, job.state = message(error), "error"
            if not isinstance(error, (ValueError, KeyError, IndexError)):
                traceback.print_exc()
        finally:
            job.finished = time.time()
            with self.changed:
                self.changed.notify_all()
