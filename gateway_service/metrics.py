"""The gateway's Prometheus metrics: one observation per request, whichever API it came by.

A request's `RequestObservation` (`GatewayMetrics.observation`) wraps its output stream, and
the sink its plain tokens may take instead (plain_lane.py): it times the first chunk (time to
first token), the gaps between tokens (inter-token latency) and the whole request, counts
prompt and generated tokens from the final usage, and counts the request by API, status and
finish reason. A request that fails counts with the gRPC status name of its error (the same
mapping the caller sees, `errors.to_status`) and an empty finish reason. A request refused
before it could start (the HTTP API's 401, 413, malformed body, unknown model) is counted by
`rejected`. Either way the request gets its access-log line (`access_log`). Embedding requests
(`observe_embedding`) count the same way, with prompt tokens only and no finish reason.

Every labelled series exists at 0 from the first request that knows the model name on, so
rates and alerts work before the first failure of a kind.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client import CollectorRegistry

from gateway_service.access_log import RequestRecord, log_request
from gateway_service.caller import Caller
from gateway_service.errors import status_of
from gateway_service.plain_lane import Sink
from radixserve.finish_reason import finish_reason_text
from radixserve.loop_histogram import LoopHistogram
from radixserve.metrics import LATENCY_BUCKETS_S, MODEL_LABEL, counter, latency_histogram, name
from radixserve.v1 import generation_pb2

# Values of the `api` label.
API_GRPC = "grpc"
API_GRPC_MANY = "grpc_many"  # a request of a GenerateMany call
API_CHAT = "chat_completions"
API_COMPLETIONS = "completions"
API_MODELS = "models"
API_EMBED = "grpc_embed"
API_EMBEDDINGS = "embeddings"
APIS = (API_GRPC, API_GRPC_MANY, API_CHAT, API_COMPLETIONS, API_MODELS, API_EMBED, API_EMBEDDINGS)
# APIs that answer embeddings: their requests end without a finish reason.
EMBEDDING_APIS = (API_EMBED, API_EMBEDDINGS)
# The route of each API in the access log (HTTP paths; the gRPC method).
ROUTES = {API_GRPC: "/radixserve.v1.GenerationService/Generate",
          API_GRPC_MANY: "/radixserve.v1.GenerationService/GenerateMany", API_CHAT: "/v1/chat/completions",
          API_COMPLETIONS: "/v1/completions", API_MODELS: "/v1/models",
          API_EMBED: "/radixserve.v1.GenerationService/Embed", API_EMBEDDINGS: "/v1/embeddings"}
STATUS_OK = "ok"
# The (status, finish reason) series declared at 0 for every API (embeddings: `ok` alone).
FAILURES = tuple((status, "") for status in ("INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "RESOURCE_EXHAUSTED",
                                             "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL"))
DECLARED_OUTCOMES = ((STATUS_OK, "stop"), (STATUS_OK, "length"), *FAILURES)
EMBEDDING_OUTCOMES = ((STATUS_OK, ""), *FAILURES)


class GatewayMetrics:
    """Counters and histograms of requests; `model_name` is read when a request starts."""

    def __init__(self, model_name: Callable[[], str], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._model_name = model_name
        r, api = self.registry, ["api"]
        self.requests = counter(r, "requests", "Requests ended, by API, status and finish reason.",
                                [*api, "status", "finish_reason"])
        self.prompt_tokens = counter(r, "prompt_tokens", "Prompt tokens of finished requests.", api)
        self.generation_tokens = counter(
            r, "generation_tokens", "Tokens generated and sent to callers.", api)
        self.cached_prompt_tokens = counter(
            r, "cached_prompt_tokens", "Prompt tokens of finished requests served from the prefix cache.", api)
        self.ttft = latency_histogram(
            r, "time_to_first_token_seconds", "From request arrival to its first token.", api)
        # Observed for every streamed token, on the event loop alone: plain counts, no locks.
        self.itl = LoopHistogram(name("inter_token_latency_seconds"), "Between consecutive tokens of one request.",
                                 [MODEL_LABEL, *api], LATENCY_BUCKETS_S, r)
        self.e2e = latency_histogram(
            r, "e2e_request_latency_seconds", "From request arrival to its last token.", api)
        self._declared: set[str] = set()

    def _model(self) -> str:
        model = self._model_name()
        if model and model not in self._declared:
            self._declared.add(model)
            for name in APIS:
                for status, finish in EMBEDDING_OUTCOMES if name in EMBEDDING_APIS else DECLARED_OUTCOMES:
                    self.requests.labels(model, name, status, finish)
                for series in (self.prompt_tokens, self.generation_tokens, self.cached_prompt_tokens,
                               self.ttft, self.itl, self.e2e):
                    series.labels(model, name)
        return model

    def rejected(self, api: str, caller: Caller, exc: BaseException, started: float) -> None:
        """Count and log a request refused before it started (`started` on `time.monotonic()`)."""
        status = status_of(exc).name
        self.requests.labels(self._model(), api, status, "").inc()
        log_request(caller, RequestRecord(ROUTES[api], status, total_s=time.monotonic() - started))

    async def observe_embedding(
        self, api: str, caller: Caller, call: Awaitable[generation_pb2.EmbedResponse]
    ) -> generation_pb2.EmbedResponse:
        """`call`'s answer, the request counted (prompt and cached tokens, latency, status) and
        logged as a generation request is; it has no output tokens and no finish reason."""
        model = self._model()
        start = time.monotonic()
        status = "CANCELLED"
        record = RequestRecord(ROUTES[api])
        try:
            response = await call
            status = STATUS_OK
            self.prompt_tokens.labels(model, api).inc(response.usage.prompt_tokens)
            self.cached_prompt_tokens.labels(model, api).inc(response.usage.cached_tokens)
            self.e2e.labels(model, api).observe(time.monotonic() - start)
            record.prompt_tokens, record.cached_tokens = response.usage.prompt_tokens, response.usage.cached_tokens
            return response
        except Exception as exc:
            status = status_of(exc).name
            raise
        finally:
            self.requests.labels(model, api, status, "").inc()
            record.status, record.total_s = status, time.monotonic() - start
            log_request(caller, record)

    def observation(self, api: str, caller: Caller) -> RequestObservation:
        """A request's metrics from now on: `observe` its stream, and `observed` a sink it feeds."""
        return RequestObservation(self, api, caller)


class RequestObservation:
    """One request's metrics: its chunks are counted as they pass, whether through `observe`'s
    generator or, for chunks handed to the caller without it (the gateway's plain-token lane,
    see router_stream.py), through the sink `observed` wraps."""

    __slots__ = ("_metrics", "_api", "_model", "_start", "_last", "_num_tokens", "_status", "_finish",
                 "_record", "_itl", "_caller")

    def __init__(self, metrics: GatewayMetrics, api: str, caller: Caller) -> None:
        self._metrics, self._api = metrics, api
        self._model = metrics._model()
        self._start = self._last = time.monotonic()
        self._num_tokens = 0
        self._status, self._finish = "CANCELLED", ""
        self._record = RequestRecord(ROUTES[api])
        self._itl = metrics.itl.labels(self._model, api)  # looked up once: it is observed for every token
        self._caller = caller

    def observed(self, sink: Sink) -> Sink:
        """`sink`, each chunk counted before it is passed on."""
        def observed_sink(chunk: generation_pb2.GenerateResponse) -> None:
            self._chunk(chunk, time.monotonic())
            sink(chunk)
        return observed_sink

    async def observe(
        self, stream: AsyncIterator[generation_pb2.GenerateResponse]
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Yield `stream`'s chunks unchanged, recording the request's metrics on the way (one
        stream, observed once). The caller must close this generator (`contextlib.aclosing`) or
        drain it; a stream abandoned early (a disconnected client) counts as CANCELLED."""
        try:
            async for chunk in stream:
                self._chunk(chunk, time.monotonic())
                yield chunk
        except Exception as exc:
            self._status = status_of(exc).name
            raise
        finally:
            metrics, model, api, record = self._metrics, self._model, self._api, self._record
            metrics.requests.labels(model, api, self._status, self._finish).inc()
            record.status, record.finish_reason = self._status, self._finish
            record.output_tokens = record.output_tokens or self._num_tokens
            record.total_s = time.monotonic() - self._start
            log_request(self._caller, record)

    def _chunk(self, chunk: generation_pb2.GenerateResponse, now: float) -> None:
        metrics, record = self._metrics, self._record
        num_chunk_tokens = len(chunk.token_ids)
        if num_chunk_tokens:
            if self._num_tokens == 0:
                record.ttft_s = now - self._start
                metrics.ttft.labels(self._model, self._api).observe(record.ttft_s)
            else:
                # Tokens that arrive together share the gap since the previous ones.
                gap = (now - self._last) / num_chunk_tokens
                observe = self._itl.observe
                for _ in range(num_chunk_tokens):
                    observe(gap)
            self._num_tokens += num_chunk_tokens
            self._last = now
        if chunk.HasField("usage"):
            usage, model, api = chunk.usage, self._model, self._api
            metrics.prompt_tokens.labels(model, api).inc(usage.prompt_tokens)
            metrics.generation_tokens.labels(model, api).inc(usage.completion_tokens)
            metrics.cached_prompt_tokens.labels(model, api).inc(usage.cached_tokens)
            record.prompt_tokens = usage.prompt_tokens
            record.cached_tokens = usage.cached_tokens
            record.output_tokens = usage.completion_tokens
        if chunk.finish_reason:
            self._status, self._finish = STATUS_OK, finish_reason_text(chunk.finish_reason)
            metrics.e2e.labels(self._model, self._api).observe(now - self._start)
