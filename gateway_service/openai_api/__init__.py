"""The OpenAI-compatible HTTP API of the gateway (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`), mapped onto the same `GenerateInput` and validation as the gRPC API."""
