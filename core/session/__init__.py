"""Layer 6: a request built and checked once, and loaded: the Python API (accelgen.load, accelgen.generate)."""
