"""`X-Request-Id` for the HTTP API: the caller's when usable (printable ASCII within
`--max-request-id-len`), else a new one; kept in the request's state for the routes (logs,
the router's id) and echoed on every response, errors included."""

from __future__ import annotations

from gateway_service.caller import REQUEST_ID_HEADER, request_id_from

_HEADER = REQUEST_ID_HEADER.encode()
# Where routes find it: `request.state.request_id`.
STATE_KEY = "request_id"


class RequestIds:
    """Pure ASGI middleware (it adds a header without buffering streamed responses)."""

    def __init__(self, app, max_len: int) -> None:
        self.app = app
        self.max_len = max_len

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        presented = next((value.decode("latin-1") for key, value in scope["headers"] if key == _HEADER), None)
        request_id = request_id_from(presented, self.max_len)
        scope.setdefault("state", {})[STATE_KEY] = request_id
        echoed = request_id.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (_HEADER, echoed)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
