"""Layer 3: many processes: launching ranks, the process group, DeepSpeed tensor parallelism, vocabulary parallelism."""
