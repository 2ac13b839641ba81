"""The gateway's configuration: one frozen value, each field a setting declared once (flag and
`RADIXSERVE_*` variable, see `radixserve.flags`)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway_service.bounded_load import Bounds
from gateway_service.reasoning import AUTO, HARMONY, REASONING_PARSERS
from gateway_service.tool_parsers import TOOL_CALL_PARSERS
from gateway_service.validation import RequestLimits
from radixserve import flags
from radixserve.flags import nested, setting
from radixserve.security import SecurityConfig, security_settings
from radixserve.constraints import MAX_CONSTRAINT_CHARS
from radixserve.shared_flags import (
    CONSTRAINT_CACHE_SIZE,
    HOST,
    HTTP_PORT,
    LOG_FORMAT,
    LOG_LEVEL,
    METRICS_PORT,
    MODEL,
    PORT,
)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = HOST()
    port: int = PORT(50051)
    model: str = MODEL(help="model folder or GGUF file (tokenizer and chat template)")
    routers: tuple[str, ...] = setting(("127.0.0.1:50052",), "comma-separated router addresses, one per "
                                       "model replica (may be empty with --router-dns)", min=0)
    router_dns: str = setting("", "host:port of a headless Service whose addresses are routers (one per model "
                              "replica), added to --routers and re-resolved every --router-dns-interval-s: "
                              "new ones join, removed ones are drained")
    router_dns_interval_s: float = setting(5.0, "seconds between resolutions of --router-dns", above=0)
    load_bound: float = setting(1.1, "bounded-load prefix affinity: a request goes to the first router in its "
                                "order whose outstanding requests, with it, stay within this many times the "
                                "mean, rounded down but never below the mean rounded up (1: even load; large: "
                                "pure prefix affinity)", min=1)
    memory_load_bound: float = setting(1.4, "the bound for the routers the prefix memory names as holding a "
                                       "request's longest known shared prefix (a system prompt spilled over a "
                                       "few routers stays on those): taken while their outstanding requests, "
                                       "with this one, stay within this many times the mean (never less than "
                                       "--load-bound)",
                                       min=1)
    session_load_bound: float = setting(1.4, "as --memory-load-bound, for the router holding a conversation's "
                                        "history (the request's longest known prefix ended an earlier prompt; "
                                        "never less than --load-bound)",
                                        min=1)
    recompute_tokens: int = setting(64, "route by work: prompt tokens whose recomputation on another router "
                                    "costs as much as one more outstanding request above --load-bound on a "
                                    "router the prefix memory names as holding them; a request goes to "
                                    "the router (among those the memory names within their bound, and the "
                                    "first in its order) costing the least of the two (0: the memory's "
                                    "routers in their order while within their bound)", min=0)
    prefix_memory_entries: int = setting(262144, "prompt prefixes remembered with the routers they went to, so a "
                                         "conversation's next turn meets its cached history (0: none)", min=0)
    prefix_memory_stride: int = setting(64, "tokens between the prefixes remembered of one prompt", min=1)
    prefix_memory_holders: int = setting(16, "routers remembered per prefix, most recent first (a hot prefix "
                                         "spilled over several routers is held by each)", min=1)
    default_max_tokens: int = setting(256, "max_tokens when a request leaves it unset (capped by what the "
                                      "context leaves)", min=1)
    affinity_tokens: int = setting(64, "leading prompt tokens hashed to choose a router, so shared prefixes "
                                   "meet their cache", min=0)
    probe_interval_s: float = setting(2.0, "seconds between GetServerInfo probes of the routers", above=0)
    probe_timeout_s: float = setting(2.0, "timeout of one router probe, in seconds", above=0)
    shutdown_grace_s: float = setting(20.0, "on SIGTERM: NOT_SERVING at once, new calls refused, open "
                                      "streams get this many seconds to finish", min=0)
    log_level: str = LOG_LEVEL()
    log_format: str = LOG_FORMAT()
    http_port: int = HTTP_PORT()
    max_choices: int = setting(16, "choices one HTTP request may ask for (n times the prompts of a batch)",
                               min=1)
    max_embed_inputs: int = setting(256, "inputs one Embed call (or /v1/embeddings request) may hold",
                                    min=1)
    metrics_port: int = METRICS_PORT(50151)
    constraint_timeout_s: float = setting(2.0, "a constraint that takes longer to compile is stopped and "
                                          "rejected (INVALID_ARGUMENT); a request waiting this long for a "
                                          "free compile process gets RESOURCE_EXHAUSTED", above=0)
    constraint_cache_size: int = CONSTRAINT_CACHE_SIZE(help="distinct constraints whose verdict is kept")
    constraint_processes: int = setting(2, "processes that compile constraints (one that runs past "
                                        "--constraint-timeout-s is killed and replaced)", min=1)
    constraint_compiles_per_client: int = setting(1, "constraint compiles one client (API token, else "
                                                  "address) may have running at once; more get "
                                                  "RESOURCE_EXHAUSTED", min=1)
    constraint_start_timeout_s: float = setting(60.0, "how long a compile process may take to start",
                                                above=0)
    max_constraint_chars: int = setting(131072, "characters of a constraint's schema, regex or grammar "
                                        "(of all its choices together)", min=1, max=MAX_CONSTRAINT_CHARS)
    http_header_timeout_s: float = setting(10.0, "seconds a connection gets to send a complete request "
                                           "head (HTTP) or finish its handshake (gRPC) before it is "
                                           "closed", above=0)
    http_keep_alive_s: float = setting(5.0, "seconds an idle HTTP keep-alive connection stays open",
                                       above=0)
    max_connections: int = setting(1024, "open connections on each public port: past it HTTP answers "
                                   "503 and gRPC refuses new connections", min=1)
    grpc_max_streams: int = setting(100, "concurrent calls on one gRPC connection", min=1)
    max_requests_per_call: int = setting(1024, "requests one GenerateMany call may have open at once; more "
                                         "get RESOURCE_EXHAUSTED", min=1)
    grpc_idle_timeout_s: float = setting(300.0, "seconds a gRPC connection with no call open stays open",
                                         above=0)
    tokenizer_threads: int = setting(2, "threads of each pool (encode: tokenization and chat templates; "
                                     "decode: detokenization) that keep that work off the event loop", min=1)
    tool_call_parser: str = setting("auto", "how the model writes tool calls (hermes, llama3_json, mistral, "
                                    "harmony: gpt-oss's messages to functions.NAME, glm45, minimax_m2, "
                                    "qwen3_coder, deepseek_v3: V3 and R1, deepseek_v31, kimi_k2); auto: from "
                                    "the chat template (harmony when it has <|channel|>), hermes when it shows "
                                    "none", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str = setting("auto", "split <think>...</think> into reasoning_content (think), or "
                                    "gpt-oss's analysis channel into reasoning_content and its final channel "
                                    "into content (harmony, which needs --tool-call-parser harmony or auto), "
                                    "or not (none); auto: harmony when the chat template has <|channel|>, "
                                    "else think when it has <think> or </think>",
                                    choices=REASONING_PARSERS)
    limits: RequestLimits = nested(RequestLimits)
    security: SecurityConfig = security_settings(public=True)

    @property
    def bounds(self) -> Bounds:
        load = self.load_bound
        return Bounds(load, max(load, self.memory_load_bound), max(load, self.session_load_bound),
                      self.recompute_tokens)

    def __post_init__(self) -> None:
        flags.check(self)
        if not self.routers and not self.router_dns:
            raise ValueError("--routers or --router-dns must name at least one router")
        flags.check_addresses("routers", self.routers)  # one named twice is one router
        if self.router_dns:
            flags.split_address(self.router_dns, "router-dns")
        parsers = (self.reasoning_parser, self.tool_call_parser)
        if HARMONY in parsers and AUTO not in parsers and parsers != (HARMONY, HARMONY):
            raise ValueError("--reasoning-parser and --tool-call-parser: harmony is one format for reasoning and "
                             "tool calls; give both harmony, or auto to the other")


PROGRAM = flags.Program(
    GatewayConfig, "python -m gateway_service", "radixserve gateway (GenerationService)"
)
config_from_args = PROGRAM.parse
