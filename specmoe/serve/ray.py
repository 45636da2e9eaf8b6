"""Scale-out: replicas of ``specmoe serve`` behind Ray Serve (the ``ray`` extra).

One machine's server is one process with one expert cache; when requests outgrow it, Ray Serve
runs N replicas of the same app (:func:`specmoe.serve.app` over the checkpoint, each replica
loading it itself, on whichever node of the Ray cluster has room) behind its own HTTP proxy,
request router and autoscaler.  Nothing of specmoe's runs between the replicas: each one is
the single-process server, with its own scheduler, continuous batching and metrics; Ray Serve
picks the replica per request (power of two choices on queue length).

From Python::

    from ray import serve
    from specmoe.serve.ray import deployment

    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(deployment("path/to/checkpoint", replicas=2, cache="25%", dtype="int4"))

or ``specmoe serve CHECKPOINT --ray --replicas 2`` (a local Ray instance, or the cluster at
``$RAY_ADDRESS``).  Every response carries ``x-specmoe-replica`` (the Ray replica's id), so a
client or a test can see which replica answered; ``/metrics`` and ``/health`` are those of the
replica that answered.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

__all__ = ["deployment", "tag_replica"]


def tag_replica(asgi: Any, tag: str) -> Any:
    """``asgi`` with an ``x-specmoe-replica: tag`` header on every HTTP response (lifespan
    and other scopes pass through untouched)."""
    value = tag.encode("latin-1", "replace")

    async def tagged(scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await asgi(scope, receive, send)
            return

        async def send_tagged(msg: Dict[str, Any]) -> None:
            if msg.get("type") == "http.response.start":
                msg = dict(msg)
                msg["headers"] = list(msg.get("headers") or []) + [
                    (b"x-specmoe-replica", value)]
            await send(msg)

        await asgi(scope, receive, send_tagged)

    return tagged


def deployment(checkpoint: Union[str, os.PathLike], *, replicas: Optional[int] = 2,
               autoscaling: Optional[Dict[str, Any]] = None, num_cpus: float = 1.0,
               threads: Optional[int] = None, name: str = "specmoe",
               draft_model: Optional[Union[str, os.PathLike]] = None,
               **app_kwargs: Any) -> Any:
    """A Ray Serve application serving ``checkpoint`` from ``replicas`` replicas of
    :func:`specmoe.serve.app` (``app_kwargs`` go to it: ``cache``, ``dtype``, ``max_batch``,
    ``api_key``, ``model_name``, from_pretrained's options...).

    ``autoscaling``: Ray Serve's ``autoscaling_config`` (``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests``...) instead of a fixed ``replicas``.  ``num_cpus``: the CPUs
    Ray reserves per replica; ``threads``: torch's and specmoe's kernel threads in each
    replica (default: ``num_cpus`` rounded, at least 1).  ``draft_model``: a draft LM's
    checkpoint folder, loaded in each replica as its drafter
    (:meth:`specmoe.speculation.drafters.DraftModel.from_pretrained`; ``drafter`` then stays
    unset).  Returns the bound application for ``serve.run``.  The checkpoint (and the draft
    model) must be readable at the same path on every node."""
    try:
        from ray import serve
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError("specmoe.serve.ray needs Ray Serve: pip install 'specmoe[ray]'") \
            from exc
    if (replicas is None) == (autoscaling is None):
        raise ValueError("give either replicas (a fixed count) or autoscaling (a config)")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                 or replicas < 1):
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    path = str(Path(checkpoint).expanduser())
    if not Path(path).exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if draft_model is not None:
        if app_kwargs.get("drafter") not in (None, "none"):
            raise ValueError("give either drafter or draft_model")
        draft_model = str(Path(draft_model).expanduser())
        if not (Path(draft_model) / "config.json").is_file():
            raise FileNotFoundError(f"draft model not found (no config.json): {draft_model}")
        app_kwargs = dict(app_kwargs, draft_model=draft_model)
    n_threads = int(threads) if threads is not None else max(1, int(round(num_cpus)))
    max_ongoing = int(app_kwargs.get("max_batch", 16)) + int(app_kwargs.get("max_queue", 256))

    @serve.ingress()
    class SpecmoeReplica:
        """One replica: the single-process server over its own copy of the model."""

        def __init__(self, checkpoint: str, kwargs: Dict[str, Any], threads: int) -> None:
            self.checkpoint, self.kwargs, self.threads = checkpoint, kwargs, threads

        def __serve_build_asgi_app__(self) -> Any:
            import torch

            from ..runtime import kernels
            from . import app
            torch.set_num_threads(self.threads)
            kernels.set_num_threads(self.threads)
            kw = dict(self.kwargs)
            draft = kw.pop("draft_model", None)
            if draft is not None:  # loaded here: one copy per replica, as the model
                from ..speculation.drafters import DraftModel
                kw["drafter"] = DraftModel.from_pretrained(draft)
            if isinstance(kw.get("policy"), str):  # a spec, as specmoe run's --policy
                from ..sim.replay import live_policy
                kw["policy"] = live_policy(kw["policy"])
            replica = serve.get_replica_context().replica_id
            return tag_replica(app(self.checkpoint, **kw),
                               getattr(replica, "unique_id", None) or str(replica))

    opts: Dict[str, Any] = {"name": name, "ray_actor_options": {"num_cpus": num_cpus},
                            "max_ongoing_requests": max_ongoing}
    if autoscaling is not None:
        opts["autoscaling_config"] = dict(autoscaling)
    else:
        opts["num_replicas"] = replicas
    return serve.deployment(SpecmoeReplica, **opts).bind(path, dict(app_kwargs), n_threads)
