"""The explorer's background jobs: a queue on one worker thread, each job's state and progress.

A request that starts a long computation (patching, circuits, a feature pass over a harvest) gets the
job's id at once; the page polls `/api/jobs/{id}`. One computation touches the model at a time (`lock`):
hooks are state on the model, and two runs adding hooks at once would see each other's.
"""

import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field


@dataclass
class Job:
    """A background computation: `state` queued → running → done | error; `progress` in [0, 1] where the
    function reports it (None: unknown); `result` the JSON it returned, `error` the message it raised."""

    id: str
    kind: str
    state: str = "queued"
    progress: float | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None
    result: object = None
    error: str | None = None

    def status(self) -> dict:
        elapsed = (self.finished or time.time()) - self.started
        return {**asdict(self), "elapsed": elapsed}


def message(error: Exception) -> str:
    """The user's message for an exception: its text (a KeyError's without the quotes repr adds)."""
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    return str(error) or type(error).__name__


class Jobs:
    """The queue: `submit` a function of its Job, look a job up by id. `lock` is the model's."""

    def __init__(self, lock: threading.Lock):
        self.lock = lock
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="explorer-job")
        self.jobs: dict[str, Job] = {}

    def submit(self, kind: str, work: Callable[[Job], object]) -> dict:
        job = Job(uuid.uuid4().hex[:12], kind)
        self.jobs[job.id] = job

        def run():
            job.state = "running"
            try:
                with self.lock:
                    job.result = work(job)
                job.progress, job.state = 1.0, "done"
            except Exception as error:  # noqa: BLE001 - any failure is the job's message; the server serves on
                job.error, job.state = message(error), "error"
                if not isinstance(error, (ValueError, KeyError, IndexError)):
                    traceback.print_exc()
            job.finished = time.time()

        self.pool.submit(run)
        return {"job": job.id, "kind": kind}

    def get(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise KeyError(job_id)
        return self.jobs[job_id]
