"""The explorer under load: interactive requests' latency while a long job runs, a cancel's delay, and how
long the command line's server takes to stop on SIGTERM and SIGINT with jobs running (loopback only).

    python benchmarks/explorer_load.py              # writes benchmarks/results/explorer_load.json

The views: 5 clients, 10 requests each (prompt, attention and the model's description in turn), while a
job of hooked forwards (one Step reported after each, as the library's long functions do) runs on the
jobs' replica, on the embedded Arcee. The cancels: that job's, then the page's own circuit job cancelled
at several moments of its run (a job stops at its next batch boundary, so a cancel waits for the rest of
the batch it is in). The stops: a page's polling under way, as in use. tests/hooked_models/explorer/test_jobs.py asserts the ordering
(every view answered while the job ran); this script measures the times.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import Results  # noqa: E402

PROMPT = "When Mary and John went to the store together, John gave a drink to"
FINISHED = ("done", "error", "cancelled")


def call(url: str, path: str, body: dict | None = None, method: str | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def views_under_load(clients: int, requests: int) -> dict:
    import uvicorn

    from hooked_models import HookedArcee
    from hooked_models.explorer import create_app
    from hooked_models.progress import Step

    model = HookedArcee.from_pretrained("embedded").eval()
    app = create_app(model)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url, explorer = f"http://127.0.0.1:{port}", app.state.explorer
    batches = []

    def work(replica, job):
        tokens = replica.to_tokens(PROMPT)
        for done in range(10**6):
            with torch.no_grad(), replica.hooks(fwd_hooks=[("layers.0.layer_input", lambda v, hook: v * 1.0)]):
                replica(tokens)
            batches.append(time.perf_counter())
            job.report(Step(done + 1, 10**6, "forwards", "batch"))

    job = explorer.submit("long", work)["job"]
    while not batches:
        time.sleep(0.01)
    latencies = []

    def client(k: int):
        for i in range(requests):
            path, body = [("/api/prompt", {"prompt": PROMPT}), ("/api/attention", {"prompt": PROMPT}),
                          ("/api/model", None)][(k + i) % 3]
            began = time.perf_counter()
            call(url, path, body)
            latencies.append(time.perf_counter() - began)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    state = call(url, f"/api/jobs/{job}")["state"]
    asked = time.perf_counter()
    call(url, f"/api/jobs/{job}", method="DELETE")
    while call(url, f"/api/jobs/{job}")["state"] != "cancelled":
        time.sleep(0.005)
    cancelled = time.perf_counter() - asked
    gaps = [b - a for a, b in zip(batches, batches[1:])]
    circuit = cancel_circuits(url)
    explorer.queue.shutdown()
    server.should_exit = True
    return {"requests": len(latencies), "clients": clients, "job_state_after": state,
            "p50_s": percentile(latencies, 0.5), "p90_s": percentile(latencies, 0.9),
            "p99_s": percentile(latencies, 0.99), "max_s": max(latencies), "cancel_s": cancelled,
            "batch_s": statistics.median(gaps), "batches_during": len(batches), **circuit}


# When the DELETE comes after the circuit job starts running, as fractions of the whole job's time: in its
# first runs, its EAP-IG passes, its faithfulness curve's patches.
CANCEL_AT = (0.0, 0.1, 0.2, 0.35, 0.5, 0.65)


def cancel_circuits(url: str) -> dict:
    """DELETE to `cancelled` for an explorer circuit job (EAP-IG, 100 steps, PROMPT four times over: 64
    tokens), once per fraction CANCEL_AT of the whole job's time after it starts running: a running job stops at its next batch
    boundary, so this is the rest of the batch it is in. Also how long the whole job takes."""
    long = " ".join([PROMPT] * 4)
    pair = {"clean": long, "corrupted": long[: -len("John gave a drink to")] + "Mary gave a drink to",
            "answer": " Mary", "wrong": " John", "steps": 100}
    job = call(url, "/api/circuit", pair)["job"]
    while (status := call(url, f"/api/jobs/{job}"))["state"] not in FINISHED:
        time.sleep(0.01)
    whole = status["elapsed"]
    waits = []
    for delay in (whole * at for at in CANCEL_AT):
        job = call(url, "/api/circuit", pair)["job"]
        while (status := call(url, f"/api/jobs/{job}"))["state"] != "running":
            time.sleep(0.002)
        time.sleep(delay)
        asked = time.perf_counter()
        call(url, f"/api/jobs/{job}", method="DELETE")
        while (status := call(url, f"/api/jobs/{job}"))["state"] not in FINISHED:
            time.sleep(0.005)
        if status["state"] == "cancelled":  # (a run faster than the first may finish before its cancel)
            waits.append(time.perf_counter() - asked)
    if len(waits) < 3:
        raise RuntimeError(f"only {len(waits)} of the circuit jobs were still running at their cancel")
    return {"circuit_job_s": whole, "circuit_cancel_median_s": statistics.median(waits),
            "circuit_cancel_max_s": max(waits), "circuit_cancel_s": waits}


def stop_on(stop: signal.Signals) -> float:
    """Seconds from the signal to the command line's exit, with three long EAP-IG jobs queued and a client
    polling the first every 150 ms, as the page does."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "hooked_models", "explore", "--port", str(port)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    server.stdout.readline()
    url = f"http://127.0.0.1:{port}"
    long = " ".join([PROMPT] * 4)
    pair = {"clean": long, "corrupted": long[: -len("John gave a drink to")] + "Mary gave a drink to",
            "answer": " Mary", "wrong": " John", "method": "eap-ig", "steps": 1000}
    jobs = [call(url, "/api/circuit", pair)["job"] for _ in range(3)]
    while call(url, f"/api/jobs/{jobs[0]}")["state"] != "running":
        time.sleep(0.05)

    def poll():  # the page's loop (static/common.js runJob): a status every 150 ms until the server is gone
        try:
            while True:
                call(url, f"/api/jobs/{jobs[0]}")
                time.sleep(0.15)
        except OSError:
            return

    threading.Thread(target=poll, daemon=True).start()
    time.sleep(0.5)
    began = time.perf_counter()
    server.send_signal(stop)
    server.wait(timeout=120)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--requests", type=int, default=10, help="per client")
    args = parser.parse_args()
    record = Results("explorer_load")
    figures = views_under_load(args.clients, args.requests)
    figures.update(sigterm_stop_s=stop_on(signal.SIGTERM), sigint_stop_s=stop_on(signal.SIGINT))
    print(json.dumps(figures, indent=1))
    record.save({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()})


if __name__ == "__main__":
    main()
