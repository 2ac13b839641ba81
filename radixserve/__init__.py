"""Shared pieces of radixserve: generated protobuf code (`radixserve.v1`), flag handling,
gRPC server plumbing and the `radixserve` launcher."""
