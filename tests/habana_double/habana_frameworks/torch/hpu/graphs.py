"""Test double of ``habana_frameworks.torch.hpu.graphs``: not Habana's software.

The real wrappers capture an HPU graph on the first call for each input signature (shapes, dtypes,
devices of the tensor arguments) and on later calls copy the inputs into the captured ones and replay
the graph. A replay computes what running the function again on the same buffers computes, so this
double runs the function again; it counts captures and replays the same way the real cache would.
"""

import torch

from habana_frameworks.torch import double_record


def _input_signature(value):
    if isinstance(value, (list, tuple)):
        return tuple(_input_signature(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, _input_signature(item)) for key, item in value.items())
    if torch.is_tensor(value):
        return (tuple(value.shape), value.dtype, value.device)
    return value


def wrap_in_hpu_graph_func(func, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None):
    """``func`` captured on its first call per input signature and replayed afterwards."""
    captured = {}
    double_record["graph_wrap"] += 1

    def graphed(*args, **kwargs):
        signature = _input_signature((args, kwargs))
        if signature not in captured:
            if max_graphs is not None and len(captured) == max_graphs:
                return func(*args, **kwargs)
            captured[signature] = True
            double_record["graph_capture"] += 1
        else:
            double_record["graph_replay"] += 1
        return func(*args, **kwargs)

    return graphed


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None):
    """``module`` with its forward captured per input signature (as the real one does)."""
    module.forward = wrap_in_hpu_graph_func(module.forward, asynchronous, disable_tensor_cache, dry_run, max_graphs)
    return module
