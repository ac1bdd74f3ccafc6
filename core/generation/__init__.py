"""Layer 4: token ids in, token ids out with static shapes: the decode loop, sampling, the KV cache, the generator."""
