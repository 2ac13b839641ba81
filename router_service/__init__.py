"""The router: radix prefix cache, page allocator and continuous-batching scheduler over gRPC."""
