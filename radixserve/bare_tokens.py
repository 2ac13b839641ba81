"""Bare tokens on `RouterService.Stream` (router.proto, `RouterStreamResponse.bare_token_ids`).

Most of what a router streams is one token for a request with nothing else new: no logprobs, not
its last, and usage that only counts that token more. A caller that asks for them with this call
metadata gets such tokens as two packed columns of the step's message (request ids and tokens)
instead of an update each, which costs the router and the gateway about a microsecond a token to
build and read. Without it (an older gateway, grpcurl) every token is an update.
"""

METADATA = ("radixserve-bare-tokens", "1")
