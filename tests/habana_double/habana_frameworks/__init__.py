"""Test double of Habana's ``habana_frameworks`` package (see tests/habana_double/README.md): not Habana's software."""
