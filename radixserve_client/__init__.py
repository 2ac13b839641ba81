"""Python client of radixserve's public GenerationService (blocking and asyncio)."""

from radixserve_client.async_client import AsyncClient
from radixserve_client.errors import (
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    RadixServeError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from radixserve_client.results import Chunk, GenerateResult, ModelInfo, TokenLogprob, TopLogprob, Usage
from radixserve_client.sync_client import Client

__all__ = [
    "AsyncClient", "CancelledError", "Chunk", "Client", "DeadlineExceededError",
    "GenerateResult", "InternalError", "InvalidArgumentError", "ModelInfo", "RadixServeError",
    "ResourceExhaustedError", "TokenLogprob", "TopLogprob", "UnauthenticatedError",
    "UnavailableError", "Usage",
]
