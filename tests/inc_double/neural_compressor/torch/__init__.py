"""Test double of ``neural_compressor.torch``: not Intel's software."""
