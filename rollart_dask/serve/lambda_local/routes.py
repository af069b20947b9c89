"""The HTTP layer of the local Lambda endpoint: aiohttp routes for the Lambda REST paths onto ``LocalLambda``.

One middleware per request: a request id, the body read under the size quota, auth when a token
is set, and every failure turned into the error shape botocore parses (an endpoint fault is a
retryable 5xx, never something that looks like a reward).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import uuid

from aiohttp import web

from rollart_dask.serve.lambda_local.api import MAX_REQUEST, LambdaError
from rollart_dask.serve.lambda_local.auth import authorize, loopback_host_header
from rollart_dask.serve.lambda_local.service import LocalLambda

log = logging.getLogger(__name__)
_KEY = getattr(web, "RequestKey", None)  # typed request keys where aiohttp has them (>= 3.13)
REQUEST_ID = _KEY("request_id", str) if _KEY else "request_id"
BODY = _KEY("body", bytes) if _KEY else "body"


def make_app(service: LocalLambda, token: str | None = None, loopback: bool = False) -> web.Application:
    """``loopback``: bound to a loopback address, so a Host header naming anything else is a DNS-rebinding page's."""

    async def read_body(request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > MAX_REQUEST:
            raise LambdaError(413, "RequestEntityTooLargeException", f"Request must be smaller than {MAX_REQUEST} bytes")
        chunks, size = [], 0
        async for chunk in request.content.iter_chunked(1 << 20):
            size += len(chunk)
            if size > MAX_REQUEST:
                raise LambdaError(413, "RequestEntityTooLargeException", f"Request must be smaller than {MAX_REQUEST} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    @web.middleware
    async def middleware(request: web.Request, handler):
        request_id = str(uuid.uuid4())
        request[REQUEST_ID] = request_id
        service.requests += 1
        try:
            if loopback and not loopback_host_header(request.host):
                raise LambdaError(
                    403, "AccessDeniedException", f"Host {request.host!r} is not a loopback name: this endpoint is bound to loopback"
                )
            kind = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if request.method in ("POST", "PUT") and kind not in ("", "application/json", "application/octet-stream"):
                # (boto3's Invoke sends none; a browser's request without a CORS preflight is text/plain or a form)
                raise LambdaError(415, "UnsupportedMediaTypeException", f"Content-Type {kind!r}: send application/json")
            request[BODY] = await read_body(request)
            if token:
                why = authorize(token, request.method, request.path, request.raw_path, request.headers, request[BODY])
                if why is not None:
                    service.auth_failures += 1
                    authz = request.headers.get("Authorization", "")
                    code = "MissingAuthenticationTokenException" if not authz else "InvalidSignatureException"
                    raise LambdaError(403, code, f"Request not authorized: {why}")
            return await handler(request)
        except LambdaError as e:
            return e.response(request_id)
        except web.HTTPException as e:
            if e.status == 404:
                return LambdaError(404, "UnknownOperationException", f"Unknown operation {request.method} {request.path}").response(
                    request_id
                )
            if e.status == 405:
                return LambdaError(405, "UnknownOperationException", f"Unknown operation {request.method} {request.path}").response(
                    request_id
                )
            raise
        except Exception as e:  # a fault of the endpoint: a retryable 5xx, never something that looks like a reward
            log.exception("request %s %s failed", request.method, request.path)
            return LambdaError(500, "ServiceException", f"{type(e).__name__}: {e}").response(request_id)

    def json_body(request) -> dict:
        try:
            body = json.loads(request[BODY] or b"{}")
        except ValueError:
            raise LambdaError(400, "InvalidRequestContentException", "Could not parse request body into json") from None
        if not isinstance(body, dict):
            raise LambdaError(400, "InvalidRequestContentException", "The request body must be a JSON object")
        return body

    def reply(request, data: dict | None, status: int = 200) -> web.Response:
        headers = {"x-amzn-RequestId": request[REQUEST_ID]}
        if data is None:
            return web.Response(status=status, headers=headers)
        return web.json_response(data, status=status, headers=headers)

    async def invoke(request: web.Request):
        out = await service.invoke(
            request.match_info["name"],
            request.query.get("Qualifier"),
            request[BODY],
            request.headers.get("X-Amz-Invocation-Type", "RequestResponse"),
            request.headers.get("X-Amz-Log-Type", "None"),
            request[REQUEST_ID],
        )
        return web.Response(status=out.status, body=out.body, headers=out.headers)

    async def create(request):
        return reply(request, await service.create_function(json_body(request)), 201)

    async def update_code(request):
        return reply(request, await service.update_code(request.match_info["name"], json_body(request)))

    async def update_config(request):
        return reply(request, service.update_configuration(request.match_info["name"], json_body(request)))

    async def get_function(request):
        return reply(request, service.get_function(request.match_info["name"], request.query.get("Qualifier")))

    async def get_config(request):
        return reply(request, service.get_function(request.match_info["name"], request.query.get("Qualifier"))["Configuration"])

    async def list_functions(request):
        return reply(request, {"Functions": [p.cfg.to_api(service.region) for p in service.pools.values()]})

    async def delete(request):
        service.delete_function(request.match_info["name"], request.query.get("Qualifier"))
        return reply(request, None, 204)

    async def put_concurrency(request):
        return reply(request, service.put_concurrency(request.match_info["name"], json_body(request)))

    async def get_concurrency(request):
        pool = service.resolve(request.match_info["name"])
        return reply(request, {} if pool.cfg.reserved is None else {"ReservedConcurrentExecutions": pool.cfg.reserved})

    async def delete_concurrency(request):
        service.delete_concurrency(request.match_info["name"])
        return reply(request, None, 204)

    async def health(request):
        sock = request.transport.get_extra_info("socket") if request.transport else None
        nodelay = (
            bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)) if sock is not None and sock.family != socket.AF_UNIX else None
        )
        return reply(request, {"status": "ok", "functions": len(service.pools), "tcp_nodelay": nodelay})

    async def stats(request):
        return reply(request, service.stats())

    app = web.Application(client_max_size=MAX_REQUEST, middlewares=[middleware])
    fn = "/2015-03-31/functions/{name}"
    app.router.add_post(fn + "/invocations", invoke)
    app.router.add_post("/2015-03-31/functions", create)
    app.router.add_post("/2015-03-31/functions/", create)
    app.router.add_get("/2015-03-31/functions/", list_functions)
    app.router.add_get("/2015-03-31/functions", list_functions)
    app.router.add_get(fn, get_function)
    app.router.add_delete(fn, delete)
    app.router.add_put(fn + "/code", update_code)
    app.router.add_get(fn + "/configuration", get_config)
    app.router.add_put(fn + "/configuration", update_config)
    app.router.add_put("/2017-10-31/functions/{name}/concurrency", put_concurrency)
    app.router.add_delete("/2017-10-31/functions/{name}/concurrency", delete_concurrency)
    app.router.add_get("/2019-09-30/functions/{name}/concurrency", get_concurrency)
    app.router.add_get("/_local/health", health)
    app.router.add_get("/_local/stats", stats)

    async def lifecycle(app):
        reaper = asyncio.ensure_future(service.reaper())
        yield
        reaper.cancel()
        await service.close()

    app.cleanup_ctx.append(lifecycle)
    return app
