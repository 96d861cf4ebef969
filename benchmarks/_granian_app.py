"""The gateway's ASGI app for granian (bench_asgi.py): granian imports a module-level
app, so this one is built from ``ZMQDP_SERVE_ARGS`` (the options ``zmqdp serve`` would
take, e.g. ``--vllm MODEL --url ipc://... --engines 2``) exactly as ``zmqdp serve``
builds it (`zmqdp.gateway.serve.app_from_args`). Its lifespan connects the group on
granian's running asyncio loop (`zmqdp.aio`: trio as a guest of that loop)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex

from zmqdp.gateway.serve import add_arguments, app_from_args

_parser = argparse.ArgumentParser()
add_arguments(_parser)
_args = _parser.parse_args(shlex.split(os.environ["ZMQDP_SERVE_ARGS"]))
logging.basicConfig(level=_args.log_level.upper(), format="%(name)s: %(message)s")
app = app_from_args(_args)
