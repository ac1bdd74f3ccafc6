"""Test double of Intel Neural Compressor (see tests/inc_double/README.md): not Intel's software."""

__version__ = "0.0.0+test-double"
