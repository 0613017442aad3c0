"""The explorer: a local web app over the package's own functions (prompt and logit lens, attention,
activation patching, circuits, feature dashboards, attribution graphs), offline.

    python -m hooked_models explore --model embedded --data out      # then open http://127.0.0.1:8000

    from hooked_models.explorer import create_app, serve
    serve(model, data=["out"], saes={"resid 1": sae}, port=8000)    # from a script

The server (`server.py`, FastAPI) answers a small JSON API that the page (`static/`, plain JavaScript with
Plotly's cartesian bundle vendored) and scripts call; docs/guide/explorer.md documents it.
"""

from hooked_models.explorer.server import Explorer, create_app

__all__ = ["Explorer", "create_app", "serve"]


def serve(model, data=(), saes=None, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          sockets=None) -> None:
    """Run the explorer until SIGINT or SIGTERM, bound to `host` (this machine only unless told otherwise), or
    on `sockets` already bound. Stopping cancels every job (at its next batch) and waits at most a second
    for open connections (the page's polls)."""
    import uvicorn

    config = uvicorn.Config(create_app(model, data, saes), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=sockets)
