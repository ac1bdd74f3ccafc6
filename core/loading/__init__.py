"""Layer 5: a model from its files: model source, checkpoint files and headers, weight sources and loading, downloads,
pre-sharded folders, offload, random weights, the model's identity."""
