"""The explorer under load and faults, on loopback, bounded in count and time: views answer while a job runs
(they are not queued behind it), a cancelled job stops at its next batch leaving no hook and the model
bit-identical, a queued job is cancelled before it starts, and SIGTERM or SIGINT stop the command line's
server with a job running. Latencies are measured by benchmarks/explorer_load.py, never asserted here."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from hooked_models.explorer import create_app  # noqa: E402
from hooked_models.explorer.jobs import replica  # noqa: E402
from hooked_models.progress import Step  # noqa: E402

from .conftest import PROMPT, serve_in_thread  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def call(url: str, path: str, body: dict | None = None, method: str | None = None, timeout: float = 60) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def long_job(batches: int, hooked: list, started: threading.Event, begun_cancelled: list | None = None):
    """A job of `batches` hooked forwards of PROMPT, reporting a Step after each, as the library's long
    functions do: `batches` large enough, it would run for minutes. `hooked` records each batch's model;
    `begun_cancelled`, when given, each batch begun after the job's cancel was requested."""

    def work(model, job):
        tokens = model.to_tokens(PROMPT)
        mark = [("layers.0.layer_input", lambda value, hook: value * 1.0)]
        for done in range(batches):
            if job.cancel_requested and begun_cancelled is not None:
                begun_cancelled.append(done)
            with torch.no_grad(), model.hooks(fwd_hooks=mark):
                model(tokens)
            hooked.append(model)
            started.set()
            job.report(Step(done + 1, batches, "forwards", "batch"))
        return "finished"

    return work


def hooks_left(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def wait_for(predicate, what: str, rounds: int = 600):
    for _ in range(rounds):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {rounds * 0.05:.0f} s")


def test_the_replica_shares_the_weights_and_not_the_hooks(arcee):
    copy = replica(arcee)
    assert [p.data_ptr() for p in copy.parameters()] == [p.data_ptr() for p in arcee.parameters()]
    assert [b.data_ptr() for b in copy.buffers()] == [b.data_ptr() for b in arcee.buffers()]
    fired = []
    copy.hook_dict["layers.0.layer_input"].add_hook(lambda value, hook: fired.append(hook.name))
    tokens = arcee.to_tokens(PROMPT)
    assert torch.equal(arcee(tokens), copy(tokens)) and fired == ["layers.0.layer_input"]  # one call: the copy's
    copy.reset_hooks()
    assert hooks_left(arcee) == 0


def test_jobs_run_in_the_order_they_were_submitted():
    """First in, first out: with one job holding the worker, three more queued run in their order."""
    from hooked_models.explorer.jobs import Jobs

    queue, release, ran = Jobs(torch.nn.Linear(2, 2)), threading.Event(), []
    try:
        first = queue.submit("hold", lambda model, job: release.wait(30))["job"]
        wait_for(lambda: queue.get(first).state == "running", "the first job's start")
        queued = [queue.submit(f"job {i}", lambda model, job, i=i: ran.append(i))["job"] for i in range(3)]
        assert [queue.place(queue.get(j)) for j in queued] == [1, 2, 3]
        release.set()
        wait_for(lambda: all(queue.get(j).state == "done" for j in queued), "the queued jobs")
        assert ran == [0, 1, 2]
    finally:
        release.set()
        queue.shutdown()


def test_a_cancelled_job_that_reports_no_step_keeps_no_result():
    """A function that never reports cannot be stopped at a batch: cancelled while it runs, it runs to its
    end, and its result is dropped: the job ends "cancelled", with no result."""
    from hooked_models.explorer.jobs import Jobs

    queue, cancelled = Jobs(torch.nn.Linear(2, 2)), threading.Event()

    def silent(model, job):
        cancelled.wait(30)
        return {"answer": 42}

    try:
        job = queue.submit("silent", silent)["job"]
        wait_for(lambda: queue.get(job).state == "running", "the job's start")
        assert queue.cancel(job)["state"] == "running"  # asked; it stops when it can
        cancelled.set()
        wait_for(lambda: queue.get(job).state in ("done", "error", "cancelled"), "the job's end")
        status = queue.status(job)
        assert (status["state"], status["result"]) == ("cancelled", None)
    finally:
        cancelled.set()
        queue.shutdown()


@pytest.fixture
def served(arcee):
    app = create_app(arcee)
    url, server, thread = serve_in_thread(app)
    yield url, app.state.explorer
    app.state.explorer.queue.shutdown()
    server.should_exit = True
    thread.join(10)


def test_views_answer_while_a_job_runs_and_a_cancelled_job_leaves_the_model_as_it_was(served, arcee):
    url, explorer = served
    before = {name: tensor.clone() for name, tensor in arcee.state_dict().items()}
    hooked, started, begun_cancelled = [], threading.Event(), []
    job = explorer.submit("long", long_job(10**6, hooked, started, begun_cancelled))["job"]
    assert started.wait(30)

    # 5 clients, 10 interactive requests each (prompt, attention, the model): each answers, none after the job
    answers, failures = [], []

    def client(k: int):
        for i in range(10):
            path, body = [("/api/prompt", {"prompt": PROMPT}), ("/api/attention", {"prompt": PROMPT}),
                          ("/api/model", None)][(k + i) % 3]
            try:  # a view queued behind the job would wait for minutes: the timeout is a hang guard
                answers.append((path, call(url, path, body, timeout=20), call(url, f"/api/jobs/{job}")["state"]))
            except Exception as error:  # noqa: BLE001 - collected and reported below
                failures.append(repr(error))
                return

    clients = [threading.Thread(target=client, args=(k,)) for k in range(5)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(120)
    assert failures == [] and len(answers) == 50
    assert {state for _, _, state in answers} == {"running"}  # every one answered while the job ran
    assert all(len(answer["tokens"]) == 16 for path, answer, _ in answers if path != "/api/model")
    assert all(model is explorer.queue.model for model in hooked)  # the job ran on the replica, not the views' model

    # a second job waits behind it, visibly, and is cancelled before it starts
    second = explorer.submit("second", long_job(1, [], threading.Event()))["job"]
    queue = call(url, "/api/jobs")["jobs"]
    assert [(j["id"], j["state"], j["place"]) for j in queue] == [(job, "running", 0), (second, "queued", 1)]
    assert call(url, f"/api/jobs/{second}", method="DELETE")["state"] == "cancelled"

    # cancel the long one: it stops at its next batch (the one running when the cancel came finishes, none begins
    # after it), with no hook left on either model and the weights as before
    call(url, f"/api/jobs/{job}", method="DELETE")
    wait_for(lambda: call(url, f"/api/jobs/{job}")["state"] == "cancelled", "the cancel")
    assert begun_cancelled == []
    assert call(url, f"/api/jobs/{second}")["state"] == "cancelled" and call(url, "/api/jobs")["jobs"] == []
    assert hooks_left(arcee) == 0 and hooks_left(explorer.queue.model) == 0
    after = arcee.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    # the model is free: the next job runs at once and finishes
    third = explorer.submit("after", long_job(2, [], threading.Event()))["job"]
    wait_for(lambda: call(url, f"/api/jobs/{third}")["state"] == "done", "the next job")


def test_views_that_never_pause_do_not_starve_the_job(served):
    """Eight clients sending views back to back (some always waiting while another runs): the job still
    moves, a batch per round of views, and every view answers."""
    url, explorer = served
    hooked, started = [], threading.Event()
    job = explorer.submit("long", long_job(10**6, hooked, started))["job"]
    assert started.wait(30)
    stop, answered, failures = threading.Event(), [], []

    def client():
        while not stop.is_set():
            try:
                answered.append(call(url, "/api/attention", {"prompt": PROMPT}, timeout=20))
            except Exception as error:  # noqa: BLE001 - reported below
                failures.append(repr(error))
                return

    clients = [threading.Thread(target=client) for _ in range(8)]
    for thread in clients:
        thread.start()
    wait_for(lambda: len(answered) >= 6, "the first views")  # the storm is on
    during = len(hooked)
    wait_for(lambda: len(answered) >= 30, "thirty views")
    moved = len(hooked) - during
    stop.set()
    for thread in clients:
        thread.join(30)
    call(url, f"/api/jobs/{job}", method="DELETE")
    assert failures == []
    # each client has one view in flight, so 24 answers span at least three rounds of at most 8 views
    assert moved >= 2, f"the job took {moved} batches while 24 views answered"


# The longest pair the embedded model takes (61 of its 64 positions), at the most steps a request may ask for.
LONG = " ".join([PROMPT] * 4)
PAIR = {"clean": LONG, "corrupted": LONG[: -len("John gave a drink to")] + "Mary gave a drink to", "answer": " Mary",
        "wrong": " John", "method": "eap-ig", "steps": 1000}


# The command line with its circuit jobs made endless: each runs the real EAP-IG (1000 steps on 61 positions)
# over and over, reporting its steps, so that it ends only when cancelled.
ENDLESS = """
import runpy, sys
from hooked_models import circuits
once = circuits.edge_attribution
def endless(*args, **kwargs):
    while True:
        once(*args, **kwargs)
circuits.edge_attribution = endless
sys.argv = ["hooked_models", "explore", "--port", sys.argv[1]]
runpy.run_module("hooked_models", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_command_line_stops_on_a_signal_with_a_job_running(stop):
    # Eight jobs queued, the first running and none able to finish on its own: the server stops at the signal
    # all the same (a stop that waited for the running job, or for the queue, would never come; the wait below
    # is a hang guard, not a measure: how long the stop takes is benchmarks/explorer_load.py's figure).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-c", ENDLESS, str(port)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "explorer on http://127.0.0.1" in server.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        jobs = [call(url, "/api/circuit", PAIR)["job"] for _ in range(8)]
        # the first job running, its steps under way: the signal comes mid-job
        wait_for(lambda: (call(url, f"/api/jobs/{jobs[0]}")["done"] or 0) > 0, "the first job's first steps",
                 rounds=2400)
        assert [call(url, f"/api/jobs/{job}")["state"] for job in jobs] == ["running"] + ["queued"] * 7
        # a view in flight when the signal comes, as the page's requests are: it must not hold the stop up
        view = threading.Thread(target=call_fails, args=(url, "/api/prompt", {"prompt": PROMPT}), daemon=True)
        view.start()
        time.sleep(0.2)
        server.send_signal(stop)
        try:
            server.wait(timeout=120)  # a hang guard: the jobs never end by themselves
        except subprocess.TimeoutExpired:
            raise AssertionError("the server did not stop on the signal: it waits for a job that never ends") from None
        assert all(call_fails(url, f"/api/jobs/{job}") for job in jobs)  # nothing answers: it has stopped
        assert server.returncode in (0, 130, -stop), server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()


def call_fails(url: str, path: str, body: dict | None = None) -> bool:
    try:
        call(url, path, body)
    except OSError:
        return True
    return False
