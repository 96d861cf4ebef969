"""An OpenAI-compatible `/v1/completions` HTTP gateway over an engine group.

    from zmqdp.gateway import create_app
    app = create_app("ipc:///tmp/zmqdp-g1/g", engines=4, max_inflight="info")

`app` is a plain ASGI application. Serve it with hypercorn's trio worker (the group is
an `EngineGroup`) or with uvicorn (asyncio: `zmqdp.aio.AsyncioEngineGroup`); the
flavour is picked at lifespan startup. Or run ``python -m zmqdp serve --mock`` (serve.py).

Modules, in the order a request meets them:

* `app`: the ASGI app, its routes, the lifespan that owns the group, drain;
* `completions`: the request path, including disconnect handling;
* `openai`: the OpenAI request validation, response, chunk and error formats;
* `dialect`: the pluggable translation between OpenAI and an engine's bodies;
* `errors`: which failure gets which HTTP status;
* `metrics`: `/metrics`, a Prometheus collector over `statistics()`;
* `backends`: the little the gateway needs from trio or asyncio;
* `http`: plain-ASGI plumbing;
* `serve`: the `serve` command, hypercorn or uvicorn, SIGTERM drains.

Needs the ``gateway`` extra (prometheus-client; hypercorn or uvicorn to serve).
"""

from .app import GatewayApp, create_app
from .backends import GroupLike, StreamLike
from .dialect import CompletionRequest, Dialect, MockDialect, Piece, Prepared
from .errors import HTTPError
from .vllm_dialect import VllmDialect

__all__ = [
    "CompletionRequest",
    "Dialect",
    "GatewayApp",
    "GroupLike",
    "HTTPError",
    "MockDialect",
    "Piece",
    "Prepared",
    "StreamLike",
    "VllmDialect",
    "create_app",
]
