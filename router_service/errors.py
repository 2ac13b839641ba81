"""Why a request could not be served. Plain exceptions: `convert.status_of` maps each to its
gRPC status in one place."""

from __future__ import annotations


class RouterError(Exception):
    """Base of every error a caller of the router can see."""


class InvalidRequest(RouterError):
    """The request can never be served as given (empty prompt, max_tokens < 1, too long)."""


class QueueFull(RouterError):
    """Too many requests are waiting; the caller may retry later."""


class WorkersUnavailable(RouterError):
    """The worker group is not connected, or failed while the request was in flight."""


class ConstraintFailed(InvalidRequest):
    """Rank 0 could not keep the request's output within its constraint (the grammar library's
    per-step limits, or a token it could not take): the output so far does not follow it."""
