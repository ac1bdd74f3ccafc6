"""Test double of ``habana_frameworks.torch.distributed``: not Habana's software."""
