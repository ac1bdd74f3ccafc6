"""Layer 5: token ids in, token ids out with static shapes: the decode loop, sampling, the KV cache, the generator."""
