"""An OpenAI-compatible HTTP gateway over an engine group: `/v1/completions`,
`/v1/chat/completions`, `/v1/models`, the probes and `/metrics` (app.py).

    from zmqdp.gateway import create_app
    app = create_app("ipc:///tmp/zmqdp-g1/g", engines=4, max_inflight="info")

`app` is a plain ASGI application. Serve it with hypercorn's trio worker (the group is
an `EngineGroup`) or with uvicorn (asyncio: `zmqdp.aio.AsyncioEngineGroup`); the
flavour is picked at lifespan startup. Or run ``python -m zmqdp serve --mock`` (serve.py).

Modules, in the order a request meets them:

* `app`: the ASGI app, its routes, the lifespan that owns the group, drain;
* `completions`: the request path, including disconnect handling;
* `openai`: the OpenAI request validation, response, chunk and error formats;
* `frontend`: the pluggable translation between OpenAI and an engine's bodies
  (`MockFrontend`; `VllmFrontend` in `vllm_frontend`);
* `errors`: which failure gets which HTTP status;
* `metrics`: `/metrics`, a Prometheus collector over `statistics()`;
* `backends`: the little the gateway needs from trio or asyncio;
* `http`: plain-ASGI plumbing;
* `embed`: the disconnect watch for an embedder's own endpoints;
* `serve`: the `serve` command, uvicorn (the default) or hypercorn, SIGTERM drains.

Needs the ``gateway`` extra (prometheus-client; hypercorn or uvicorn to serve).
"""

from ._renamed import renamed
from .app import GatewayApp, create_app
from .backends import GroupLike, StreamLike
from .embed import ClientDisconnected, until_disconnected
from .errors import HTTPError
from .frontend import CompletionRequest, Frontend, MockFrontend, Piece, Prepared
from .vllm_frontend import VllmFrontend

__all__ = [
    "ClientDisconnected",
    "CompletionRequest",
    "Frontend",
    "GatewayApp",
    "GroupLike",
    "HTTPError",
    "MockFrontend",
    "Piece",
    "Prepared",
    "StreamLike",
    "VllmFrontend",
    "create_app",
    "until_disconnected",
]

__getattr__ = renamed(__name__)  # the names from before the frontend rename, deprecated
