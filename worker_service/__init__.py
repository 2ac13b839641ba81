"""The worker: one tensor-parallel rank holding a weight shard and its share of the KV pages."""
