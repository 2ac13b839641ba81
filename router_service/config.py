"""The router's configuration: one frozen value, each field a setting declared once (flag and
`RADIXSERVE_*` variable, see `radixserve.flags`)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve import flags
from radixserve.flags import nested, setting
from radixserve.security import SecurityConfig, security_settings
from radixserve.shared_flags import HOST, LOG_FORMAT, LOG_LEVEL, METRICS_PORT, PORT
from router_service.core.admission import Policy
from router_service.core.speculation import SpeculationConfig

@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = HOST()
    port: int = PORT(50052)
    workers: tuple[str, ...] = setting(("127.0.0.1:50060",), "comma-separated worker addresses, in rank order",
                                       min=1)
    max_pages: int = setting(0, "cap on KV pages (0: the smallest count the workers report)", min=0)
    max_batch_tokens: int = setting(2048, "token budget per step: decodes first, then prefill chunks", min=1)
    max_running_requests: int = setting(64, "requests in the running batch at most", min=1)
    max_queue: int = setting(512, "waiting requests before new ones get RESOURCE_EXHAUSTED", min=1)
    load_report_interval_s: float = setting(0.5, "seconds between load reports on an open Stream call whose "
                                            "requests produced no message meanwhile (gateways route by load)",
                                            above=0)
    policy: Policy = setting(Policy.LPM, "queue order: lpm (longest cached prefix first) or fcfs (arrival)")
    reconnect_interval_s: float = setting(1.0, "seconds between attempts to reach the workers while they are "
                                          "down", above=0)
    connect_timeout_s: float = setting(5.0, "seconds one worker may take to answer GetWorkerInfo while "
                                       "connecting", above=0)
    # Generous: a full 2048-token prefill chunk on a slow CPU.
    step_timeout_s: float = setting(60.0, "seconds every rank together may take to answer one step; past it "
                                    "in-flight requests fail (UNAVAILABLE) and the router reconnects", above=0)
    # Plan and send the next step while the workers run the current one (see `lookahead`).
    # Unset: off where the workers run on the CPU, where the router's work moved out of the gap
    # between steps competes with the forward pass instead; on otherwise (CUDA, or the stack
    # bench's fake worker), whose forward pass leaves the CPU to the router (a worker that costs
    # no CPU: 1.2-1.3x the tokens/s at 5 ms steps; docs/benchmarks.md, Overlap scheduling).
    overlap: bool | None = setting(None, "overlap scheduling: plan and send the next step while the workers run "
                                   "the current one (--no-overlap: strictly one step at a time); unset: off when "
                                   "the workers run on the CPU, on otherwise (CUDA)")
    # It travels in every DecodeTask entry. Its own name, so that the gateway's
    # RADIXSERVE_MAX_REQUEST_ID_LEN never tightens it under a shared environment.
    max_request_id_bytes: int = setting(512, "longest request_id accepted, in UTF-8 bytes (above the gateway's "
                                        "limit plus the 13 characters it appends)", min=0)
    shutdown_grace_s: float = setting(5.0, "seconds in-flight streams get to finish on SIGTERM", min=0)
    served_model_name: str = setting("", "the model's name in answers and in the OpenAI API's model list "
                                     "(empty: the model folder's name, as the workers report it)")
    log_level: str = LOG_LEVEL()
    log_format: str = LOG_FORMAT()
    metrics_port: int = METRICS_PORT(50152)
    security: SecurityConfig = security_settings()
    speculation: SpeculationConfig = nested(SpeculationConfig)

    def __post_init__(self) -> None:
        flags.check(self)
        flags.check_addresses("workers", self.workers, distinct=True)  # one rank each


PROGRAM = flags.Program(
    RouterConfig, "python -m router_service",
    "radixserve router: prefix cache, page allocator and batch scheduler in front of the "
    "tensor-parallel worker ranks.",
)
config_from_args = PROGRAM.parse
