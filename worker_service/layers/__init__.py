"""Building blocks of the models: tensor-parallel linear layers and embeddings, RMSNorm, RoPE."""
