"""``specmoe serve``: an OpenAI-compatible HTTP server over a specmoe model.

:func:`app` returns a Starlette ASGI app (run it with uvicorn, or mount it in another app);
:func:`run` serves it with uvicorn and a graceful SIGTERM.  The HTTP surface is
:mod:`specmoe.serve.api`, the worker thread that owns the model :mod:`specmoe.serve.scheduler`
(continuous batching: the running requests' decode steps in one batched forward), its
speculative decoding :mod:`specmoe.serve.speculate`, the streamed text
:mod:`specmoe.serve.detok`, the Prometheus series :mod:`specmoe.serve.metrics`.  Needs the
``serve`` extra (``pip install 'specmoe[serve]'``: starlette, uvicorn, prometheus-client)
besides ``hf``."""
from __future__ import annotations

from .api import ApiError, Server, app, run
from .detok import IncrementalText
from .metrics import Metrics
from .scheduler import Draining, GenParams, QueueFull, Request, Scheduler, serve_all
from .speculate import DRAFTERS, Speculation, controller_factory

__all__ = ["ApiError", "DRAFTERS", "Draining", "GenParams", "IncrementalText", "Metrics",
           "QueueFull", "Request", "Scheduler", "Server", "Speculation", "app",
           "controller_factory", "run", "serve_all"]
