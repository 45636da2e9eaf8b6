"""The OpenAI-compatible HTTP surface of ``specmoe serve`` (a Starlette ASGI app).

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /health``, ``GET /metrics``.  Request bodies are read and
checked here, field by field, before anything reaches the scheduler: every refusal is a 4xx with
OpenAI's error object ``{"error": {"message", "type", "param", "code"}}`` naming the field, and
leaves the server as it was.  Generation runs on the scheduler's worker thread
(:mod:`specmoe.serve.scheduler`); its events come back to the request's handler through an
``asyncio.Queue``.  ``stream: true`` answers with server-sent events (``data: {...}`` chunks
as OpenAI's, then ``data: [DONE]``).  A client that goes away (the connection's
``http.disconnect``) cancels its request: the worker drops it at its next look, within one
round.

Not supported (400 naming the field when asked for): ``n`` > 1, several prompts in one request,
``logprobs``/``top_logprobs``, ``echo``, ``best_of`` > 1, ``suffix``, ``logit_bias``,
presence/frequency penalties, tools and function calls, JSON response formats.  Unknown fields
are ignored, as OpenAI-compatible servers do; ``ignore_eos`` (bool) is an extension.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import signal
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .metrics import CONTENT_TYPE, Metrics
from .scheduler import Draining, GenParams, QueueFull, Request, Scheduler

__all__ = ["ApiError", "Server", "app", "run"]

_log = logging.getLogger("specmoe.serve")

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
MAX_BODY = 16 * 2**20


class ApiError(Exception):
    """A refusal: HTTP ``status`` with OpenAI's error object; ``outcome`` labels it in the
    ``specmoe_requests_total`` counter."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None, outcome: str = "invalid") -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers, self.outcome = param, code, headers, outcome

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code,
                              self.headers)


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def _jtype(v: Any) -> str:
    """The JSON type name of a decoded value (for messages)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _int(body: Dict[str, Any], name: str, default: Optional[int] = None,
         lo: Optional[int] = None, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"'{name}' must be an integer, got {_jtype(v)} {v!r}",
                   "invalid_type")
    if lo is not None and v < lo:
        raise _bad(name, f"'{name}' must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise _bad(name, f"'{name}' must be <= {hi}, got {v}")
    return v


def _num(body: Dict[str, Any], name: str, default: Optional[float], lo: float, hi: float,
         lo_open: bool = False) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"'{name}' must be a number, got {_jtype(v)} {v!r}", "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], "
                   f"got {v!r}")
    return float(v)


def _bool(body: Dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {_jtype(v)} {v!r}", "invalid_type")
    return v


def _utf8(v: str, param: str) -> str:
    """``v`` if it is encodable text (JSON's ``\\ud800`` escapes decode to lone surrogates,
    which no tokenizer takes)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(param, f"'{param}' is not valid Unicode text (a lone surrogate at "
                   f"{e.start})", "invalid_encoding") from None
    return v


def _unsupported(body: Dict[str, Any]) -> None:
    """400 for the OpenAI features this server does not have, when asked for."""
    checks = {
        "logprobs": lambda v: v not in (None, False, 0),
        "top_logprobs": lambda v: v not in (None, 0),
        "echo": lambda v: v not in (None, False),
        "best_of": lambda v: v not in (None, 1),
        "suffix": lambda v: v not in (None, ""),
        "logit_bias": lambda v: v not in (None, {}),
        "presence_penalty": lambda v: v not in (None, 0, 0.0),
        "frequency_penalty": lambda v: v not in (None, 0, 0.0),
        "tools": lambda v: v not in (None, []),
        "functions": lambda v: v not in (None, []),
        "tool_choice": lambda v: v not in (None, "none"),
        "response_format": lambda v: v is not None and not (
            isinstance(v, dict) and v.get("type") == "text"),
    }
    for name, asked in checks.items():
        if name in body and asked(body[name]):
            raise _bad(name, f"'{name}' is not supported by specmoe serve yet",
                       "unsupported_parameter")


class Server:
    """What one app serves: the model and tokenizer, the scheduler, the metrics, the checks.

    ``close()`` stops the scheduler (and closes the Engine when ``owns_engine``)."""

    def __init__(self, model: Any, tokenizer: Any, *, model_name: str,
                 api_key: Optional[str] = None, max_batch: int = 16, max_queue: int = 256,
                 prefill_chunk: int = 256, context_length: Optional[int] = None,
                 max_body_bytes: int = MAX_BODY, owns_engine: bool = False,
                 batch_decode: bool = True, prefill_ratio: Optional[float] = None,
                 drafter: Any = None, controller: Any = None,
                 mtp_adapter: Any = None, warm_tau: bool = True,
                 batch_prefill: bool = False, ttft_budget: Optional[float] = None) -> None:
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty string or None")
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.api_key = api_key
        self.max_body_bytes = int(max_body_bytes)
        self.owns_engine = owns_engine
        self.metrics = Metrics(lambda: self.scheduler.engine_stats)
        self.scheduler = Scheduler(model, tokenizer, max_batch=max_batch, max_queue=max_queue,
                                   prefill_chunk=prefill_chunk, metrics=self.metrics,
                                   batch_decode=batch_decode, prefill_ratio=prefill_ratio,
                                   drafter=drafter, controller=controller,
                                   mtp_adapter=mtp_adapter, warm_tau=warm_tau,
                                   batch_prefill=batch_prefill, ttft_budget=ttft_budget)
        cfg = model.config
        if context_length is None:
            context_length = getattr(cfg, "max_position_embeddings", None)
            if context_length is None:
                m = getattr(tokenizer, "model_max_length", None)
                context_length = m if isinstance(m, int) and m < 10**9 else 4096
        if isinstance(context_length, bool) or not isinstance(context_length, int) \
                or context_length < 2:
            raise ValueError(f"context_length must be an int >= 2, got {context_length!r}")
        self.context_length = context_length
        head = model.get_output_embeddings()
        self.vocab = int(getattr(head, "out_features", None) or head.weight.shape[0])
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = frozenset() if eos is None else frozenset(
            [int(eos)] if isinstance(eos, int) else [int(t) for t in eos])
        self.created = int(time.time())
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.scheduler.close()
        if self.owns_engine and self.scheduler.engine is not None:
            self.scheduler.engine.close()

    # -- checks ----------------------------------------------------------------------------

    def auth(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        h = request.headers.get("authorization", "")
        scheme, _, key = h.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                           outcome="unauthorized")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"}, outcome="unauthorized")

    async def body(self, request: HTTPRequest) -> Dict[str, Any]:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > self.max_body_bytes:
            raise ApiError(413, f"request body of {n} bytes is over the limit of "
                           f"{self.max_body_bytes}", code="body_too_large")
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise ApiError(413, f"request body of {len(raw)} bytes is over the limit of "
                           f"{self.max_body_bytes}", code="body_too_large")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})",
                           code="invalid_encoding") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {_jtype(body)}",
                           code="invalid_json")
        return body

    def check_model(self, body: Dict[str, Any]) -> None:
        m = body.get("model")
        if m is None:
            raise _bad("model", "'model' is required", "missing_required_parameter")
        if not isinstance(m, str):
            raise _bad("model", f"'model' must be a string, got {_jtype(m)}", "invalid_type")
        if m != self.model_name:
            raise ApiError(404, f"the model {m!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def _ids(self, ids: Any, param: str) -> List[int]:
        if not ids:
            raise _bad(param, f"'{param}' is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < self.vocab]
        if bad:
            raise _bad(param, f"'{param}' holds token ids outside [0, {self.vocab}): "
                       f"{bad[:5]!r}")
        return list(ids)

    def prompt_ids(self, body: Dict[str, Any]) -> List[int]:
        p = body.get("prompt")
        if p is None:
            raise _bad("prompt", "'prompt' is required", "missing_required_parameter")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            ids = self.tokenizer(_utf8(p, "prompt")).input_ids
            if not ids:
                raise _bad("prompt", "'prompt' makes no tokens (empty prompt)")
            return list(ids)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in p):
            return self._ids(p, "prompt")
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise _bad("prompt", "one prompt per request: specmoe serve takes a string or "
                       "one list of token ids, not several prompts")
        raise _bad("prompt", f"'prompt' must be a string or an array of token ids, got "
                   f"{_jtype(p)}", "invalid_type")

    def chat_ids(self, body: Dict[str, Any]) -> List[int]:
        msgs = body.get("messages")
        if msgs is None:
            raise _bad("messages", "'messages' is required", "missing_required_parameter")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages", "'messages' must be a non-empty array of messages",
                       "invalid_type")
        conv = []
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise _bad(where, f"'{where}' must be an object, got {_jtype(m)}",
                           "invalid_type")
            role = m.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role", f"'{where}.role' must be one of "
                           f"{', '.join(ROLES)}, got {role!r}")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" \
                            or not isinstance(part.get("text"), str):
                        raise _bad(f"{where}.content[{j}]", "only text content parts "
                                   "({'type': 'text', 'text': ...}) are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            elif content is None and role == "assistant":
                content = ""
            elif not isinstance(content, str):
                raise _bad(f"{where}.content", f"'{where}.content' must be a string or an "
                           f"array of text parts, got {_jtype(content)}", "invalid_type")
            conv.append({"role": role, "content": _utf8(content, f"{where}.content")})
        if not getattr(self.tokenizer, "chat_template", None):
            raise _bad("messages", f"the tokenizer of {self.model_name!r} has no chat "
                       "template: use /v1/completions with a plain prompt",
                       "chat_template_missing")
        try:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # the template's own errors (jinja raise_exception, ...)
            raise _bad("messages", f"the chat template refused the messages: {e}") from None
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise _bad("messages", "the messages make no tokens")
        return list(ids)

    def params(self, body: Dict[str, Any], n_prompt: int, chat: bool) -> GenParams:
        ctx = self.context_length
        if n_prompt >= ctx:
            raise ApiError(400, f"the prompt is {n_prompt} tokens; the model's context is "
                           f"{ctx} tokens, and at least one must be left to generate",
                           param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        name = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            name = "max_completion_tokens"
        mt = _int(body, name, None, lo=1)
        if mt is None:
            mt = ctx - n_prompt if chat else min(16, ctx - n_prompt)
        elif n_prompt + mt > ctx:
            raise ApiError(400, f"this model's context is {ctx} tokens; the request asks for "
                           f"{n_prompt + mt} ({n_prompt} in the prompt, {mt} to generate)",
                           param=name, code="context_length_exceeded")
        n = _int(body, "n", 1)
        if n != 1:
            raise _bad("n", f"'n' must be 1 (one choice per request), got {n}")
        temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _num(body, "top_p", None, 0.0, 1.0, lo_open=True)
        top_k = _int(body, "top_k", None, lo=-1)
        seed = _int(body, "seed", None, lo=-(2**63), hi=2**64 - 1)
        stop = body.get("stop")
        if stop is None:
            stops: List[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise _bad("stop", f"'stop' must be a string or an array of strings, got "
                       f"{_jtype(stop)}", "invalid_type")
        if len(stops) > MAX_STOP:
            raise _bad("stop", f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise _bad("stop", "stop strings must not be empty")
        for x in stops:
            _utf8(x, "stop")
        _unsupported(body)
        eos = frozenset() if _bool(body, "ignore_eos") else self.eos
        return GenParams(max_tokens=mt, temperature=float(temperature or 0.0), top_p=top_p,
                         top_k=top_k if top_k and top_k > 0 else None,
                         seed=None if seed is None else seed % 2**63, stop=stops, eos=eos)


async def _disconnected(receive: Any) -> None:
    """Returns when the client's connection closes (the ASGI ``http.disconnect``)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _next(q: "asyncio.Queue[tuple]", gone: "asyncio.Future[None]") -> Optional[tuple]:
    """The request's next event, or None when the client went away first."""
    if not q.empty():
        return q.get_nowait()
    get = asyncio.ensure_future(q.get())
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    return None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Handlers:
    """The routes of one :class:`Server`."""

    def __init__(self, server: Server) -> None:
        self.s = server

    async def health(self, request: HTTPRequest) -> Response:
        sch = self.s.scheduler
        if sch.fatal is not None:
            return JSONResponse({"status": "error", "message": str(sch.fatal)}, 503)
        if sch.draining:
            return JSONResponse({"status": "draining"}, 503)
        if sch.warming:  # as llama-server answers 503 while it loads the model
            sch.start()
            return JSONResponse({"status": "loading", "message": "measuring tau(g, B) at the "
                                 "batch sizes up to --max-batch (speculative decoding)"}, 503)
        return JSONResponse({"status": "ok", "model": self.s.model_name,
                             "waiting": sch.waiting, "running": len(sch.running)})

    async def metrics(self, request: HTTPRequest) -> Response:
        return Response(self.s.metrics.render(), media_type=CONTENT_TYPE)

    def _model_card(self) -> Dict[str, Any]:
        return {"id": self.s.model_name, "object": "model", "created": self.s.created,
                "owned_by": "specmoe"}

    async def models(self, request: HTTPRequest) -> Response:
        try:
            self.s.auth(request)
        except ApiError as e:
            self.s.metrics.request("models", e.outcome)
            return e.response()
        self.s.metrics.request("models", "success")
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        try:
            self.s.auth(request)
        except ApiError as e:
            return e.response()
        if request.path_params["model"] != self.s.model_name:
            return error_response(404, f"the model {request.path_params['model']!r} does not "
                                  "exist", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=True)

    def _failed(self, ev: Any, endpoint: str) -> Optional[Response]:
        """The response for a request that ended before its text did: a cancellation (event
        None: the client left, 499) or an error event (its status and reason); None for an
        event that carries text or the end."""
        if ev is None:
            self.s.metrics.request(endpoint, "cancelled")
            return Response(status_code=499)
        if ev[0] == "error":
            self.s.metrics.request(endpoint, "error")
            return error_response(ev[1], ev[2], type="server_error")
        return None

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        s = self.s
        endpoint = "chat" if chat else "completions"
        try:
            s.auth(request)
            body = await s.body(request)
            s.check_model(body)
            stream = _bool(body, "stream")
            so = body.get("stream_options")
            if so is not None and not isinstance(so, dict):
                raise _bad("stream_options", "'stream_options' must be an object",
                           "invalid_type")
            include_usage = _bool(so or {}, "include_usage")
            ids = s.chat_ids(body) if chat else s.prompt_ids(body)
            params = s.params(body, len(ids), chat)
        except ApiError as e:
            s.metrics.request(endpoint, e.outcome)
            return e.response()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple] = asyncio.Queue()

        def sink(ev: tuple) -> None:  # (the worker thread)
            try:
                loop.call_soon_threadsafe(q.put_nowait, ev)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        req = Request(ids, params, sink)
        try:
            s.scheduler.submit(req)
        except QueueFull as e:
            s.metrics.request(endpoint, "rejected")
            return error_response(429, f"the server is busy: {e}; retry later",
                                  type="rate_limit_error", code="rate_limit_exceeded",
                                  headers={"Retry-After": "1"})
        except Draining as e:
            s.metrics.request(endpoint, "unavailable")
            return error_response(503, str(e), type="server_error", code="unavailable",
                                  headers={"Retry-After": "5"})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        gone = asyncio.ensure_future(_disconnected(request.receive))
        handed = False
        try:
            if stream:
                # the first event before the headers: a request that fails at once gets its
                # status code (429 and 503 above, 500 here), not a 200 with an error event
                first = await _next(q, gone)
                failed = self._failed(first, endpoint)
                if failed is not None:
                    return failed
                gone.cancel()
                handed = True
                return StreamingResponse(
                    self._stream(req, q, first, rid, created, chat, include_usage, endpoint),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            pieces: List[str] = []
            while True:
                ev = await _next(q, gone)
                failed = self._failed(ev, endpoint)
                if failed is not None:
                    return failed
                if ev[0] == "text":
                    pieces.append(ev[1])
                else:
                    s.metrics.request(endpoint, "success")
                    return JSONResponse(self._full(rid, created, chat, "".join(pieces), ev[1],
                                                   ev[2]))
        finally:
            if not handed:
                gone.cancel()
                if req.finished is None:
                    s.scheduler.cancel(req)

    def _full(self, rid: str, created: int, chat: bool, text: str, reason: str,
              usage: Dict[str, int]) -> Dict[str, Any]:
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": self.s.model_name, "choices": [choice],
                "usage": usage}

    async def _stream(self, req: Request, q: "asyncio.Queue[tuple]", first: tuple, rid: str,
                      created: int, chat: bool, include_usage: bool,
                      endpoint: str) -> AsyncIterator[bytes]:
        s = self.s
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: Optional[str], reason: Optional[str], role: bool = False) -> bytes:
            if chat:
                delta: Dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None,
                          "finish_reason": reason}
            out = {"id": rid, "object": obj, "created": created, "model": s.model_name,
                   "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return _sse(out)

        ev = first
        outcome = "cancelled"
        try:
            if chat:
                yield chunk("", None, role=True)
            while True:
                if ev[0] == "text":
                    if ev[1] or ev[2]:  # one chunk per token, "" while text is held back
                        yield chunk(ev[1], None)
                elif ev[0] == "done":
                    yield chunk(None if chat else "", ev[1])
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": created,
                                    "model": s.model_name, "choices": [], "usage": ev[2]})
                    yield b"data: [DONE]\n\n"
                    outcome = "success"
                    return
                else:  # the request failed after its first token
                    yield _sse({"error": {"message": ev[2], "type": "server_error",
                                          "param": None, "code": None}})
                    yield b"data: [DONE]\n\n"
                    outcome = "error"
                    return
                ev = await q.get()
        finally:
            if req.finished is None:
                s.scheduler.cancel(req)
            s.metrics.request(endpoint, outcome)


def _load(path: str, tokenizer: Any, cache: Any, dtype: str, kwargs: Dict[str, Any]
          ) -> Tuple[Any, Any]:
    from ..models.pretrained import from_pretrained

    if tokenizer is None:
        from ..models.pretrained import load_tokenizer
        tokenizer = load_tokenizer(path)
    model = from_pretrained(path, cache=cache, dtype=dtype, **kwargs)
    return model, tokenizer


def app(model_or_path: Any, tokenizer: Any = None, *, model_name: Optional[str] = None,
        api_key: Optional[str] = None, max_batch: int = 16, max_queue: int = 256,
        prefill_chunk: int = 256, context_length: Optional[int] = None,
        max_body_bytes: int = MAX_BODY, cache: Any = "25%", dtype: str = "auto",
        batch_decode: bool = True, prefill_ratio: Optional[float] = None,
        drafter: Any = None, controller: Any = None, mtp_adapter: Any = None,
        warm_tau: bool = True, batch_prefill: bool = False,
        ttft_budget: Optional[float] = None, **load_kwargs: Any) -> Starlette:
    """An ASGI app serving ``model_or_path`` with OpenAI's API (module docstring).

    ``model_or_path``: a transformers causal LM (offloaded by specmoe or not; the app never
    closes its Engine) or a checkpoint folder / GGUF file, loaded here with
    :func:`specmoe.from_pretrained` (``cache``, ``dtype`` and ``load_kwargs`` go there; its
    Engine is closed when the app shuts down).  ``tokenizer``: required with a model, loaded
    from the folder with a path.  ``model_name``: the id clients send as ``model`` (default:
    the folder's name, else the config's ``name_or_path``'s last part).  ``api_key``: every
    ``/v1`` route then wants ``Authorization: Bearer <key>`` (``/health`` and ``/metrics``
    stay open).  ``max_batch``: requests stepped together; ``max_queue``: requests waiting
    beyond them before 429; ``prefill_chunk``: prompt tokens per step; ``context_length``:
    prompt + max_tokens limit (default: the config's ``max_position_embeddings``);
    ``batch_decode``: the running requests' decode steps in one batched forward (continuous
    batching, the default), or one forward per request (False); ``prefill_ratio``: while
    requests decode, a round's prompt chunks take about at most that many decode steps' time
    (None or 0, the default: every waiting prompt at once; :mod:`specmoe.serve.scheduler`,
    pacing); ``drafter``: speculative decoding, ``"ngram"`` (prompt lookup), ``"self"``
    (MoE-SpeQ's int4 self-draft) or ``"mtp"`` (multi-token prediction with the gated-LoRA
    adapter ``mtp_adapter``: an :class:`specmoe.speculation.mtp.MtpAdapter` or its folder)
    or a :class:`specmoe.speculation.drafters.DraftModel` (a small LM of the target's
    tokenizer, drafting on a KV cache of each request's own), None or ``"none"`` (the
    default) decodes plainly; ``controller``: how many drafts per
    step, ``"cascade"`` (the default), ``"speq"``, ``"heuristic"``, ``"static:K"`` or a
    callable returning a controller (:mod:`specmoe.serve.speculate`); ``warm_tau``: with a
    drafter whose controller prunes by tau, measure tau at every batch-size bucket up to
    ``max_batch`` when the worker starts (the default) rather than at each bucket's first
    use, which pauses every running request once; ``batch_prefill``: prompts of different
    lengths that arrive together are prefilled in batched forwards too (one expert load
    serves them all; by default only prompts of one length share one; a hybrid's prompts of
    one length, alone by default), which gives up bit-exactness (a prompt's tokens may then
    depend on its company;
    :mod:`specmoe.serve.scheduler`, exactness); ``ttft_budget``: with a drafter, seconds that
    a request's first speculative cycle may take: the controllers' largest K is profiled at
    load to fit it (MoE-SpeQ's SLO bound, :class:`specmoe.serve.speculate.Speculation`).

    The worker thread starts with the app's lifespan (or at the first request) and stops at
    its shutdown; ``app.state.server`` is the :class:`Server`."""
    owns = False
    if isinstance(model_or_path, (str, Path)):
        path = str(model_or_path)
        model, tokenizer = _load(path, tokenizer, cache, dtype, load_kwargs)
        owns = True
        name = model_name or Path(path.rstrip("/")).name
    else:
        if load_kwargs:
            raise TypeError(f"app(): {', '.join(sorted(load_kwargs))} apply to a checkpoint "
                            "path only")
        model = model_or_path
        if tokenizer is None:
            raise ValueError("app(model): give the model's tokenizer (tokenizer=...)")
        name = model_name or str(getattr(model.config, "name_or_path", "") or "").rstrip(
            "/").rsplit("/", 1)[-1] or "specmoe"
    server = Server(model, tokenizer, model_name=name, api_key=api_key, max_batch=max_batch,
                    max_queue=max_queue, prefill_chunk=prefill_chunk,
                    context_length=context_length, max_body_bytes=max_body_bytes,
                    owns_engine=owns, batch_decode=batch_decode,
                    prefill_ratio=prefill_ratio, drafter=drafter, controller=controller,
                    mtp_adapter=mtp_adapter, warm_tau=warm_tau, batch_prefill=batch_prefill,
                    ttft_budget=ttft_budget)
    h = _Handlers(server)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        server.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.close)

    async def http_error(request: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, f"{request.method} {request.url.path}: "
                              f"{exc.detail}", code=code, headers=exc.headers)

    async def internal_error(request: HTTPRequest, exc: Exception) -> Response:
        _log.exception("specmoe serve: %s %s failed", request.method, request.url.path)
        return error_response(500, f"{type(exc).__name__}: {exc}", type="server_error")

    routes = [Route("/health", h.health, methods=["GET"]),
              Route("/metrics", h.metrics, methods=["GET"]),
              Route("/v1/models", h.models, methods=["GET"]),
              Route("/v1/models/{model:path}", h.model, methods=["GET"]),
              Route("/v1/completions", h.completions, methods=["POST"]),
              Route("/v1/chat/completions", h.chat, methods=["POST"])]
    asgi = Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: internal_error})
    asgi.state.server = server
    return asgi


def run(asgi: Starlette, host: str = "127.0.0.1", port: int = 8000, *,
        shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Serve ``asgi`` (from :func:`app`) with uvicorn until SIGINT or SIGTERM.

    SIGTERM: the scheduler stops admitting (503), uvicorn stops accepting connections and waits
    up to ``shutdown_timeout`` seconds for the requests in flight (then cancels them), the
    worker and the Engine stop, and this returns normally (exit status 0).  A second SIGTERM,
    or SIGINT twice, quits at once."""
    import uvicorn

    server: Server = asgi.state.server

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            server.scheduler.drain()
            if sig == signal.SIGTERM:
                # not re-raised after the graceful shutdown (uvicorn's default), so the
                # process exits 0 once every request in flight is done
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    config = uvicorn.Config(asgi, host=host, port=port, lifespan="on", log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout)
    _Uvicorn(config).run()
