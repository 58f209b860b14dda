"""Building blocks of the models: norms, rotary embeddings, attention backends, the sampler."""
