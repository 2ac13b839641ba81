"""The OpenAI-compatible HTTP API of the gateway (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`), mapped onto the same `GenerateRequest` message and validation as the gRPC API."""
