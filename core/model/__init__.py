"""Layer 2: what a model is, whatever its weights: family differences, shapes, memory sizes, the empty skeleton."""
