"""Layer 4: quantized weights, the whole story in one place.

``--quantize SCHEME`` is offered by an accelerator that declares it (``Accelerator.quantization_schemes``); the
core refuses the others before loading. Once a rank holds its part of the model in the run's dtype, the core
calls the plugin's ``quantize`` hook (``accelgen.plugin.contract``), which does one of two things:

- **int8, weight-only** (the CPU plugin): ``int8_layer`` holds the layer (:class:`Int8Linear`: int8 values with
  one scale per output channel, input and output in the run's dtype) and the plain product any device can run;
  the plugin passes its own product when it has a faster one. ``model_layers`` replaces every linear layer but
  the output head, one at a time: a column-parallel slice holds whole rows; a row-parallel slice first agrees
  with its ranks on each row's largest magnitude, so every world size quantizes as one process does.
- **fp8 with measured activations** (the HPU plugin, through Intel Neural Compressor): the library prepares the
  model to measure, and the core's ``calibration`` passes (windows of a shipped text, one static shape, the same
  on every rank) give it the activation ranges before it converts.

Two ways skip the full-precision weights in memory: ``accelgen shard --quantize int8`` writes a pre-quantized
folder (values and ``<layer>.weight_scale`` per layer, read back into ``model_layers.empty_int8_layers``), and
``while_loading`` reads any checkpoint's weights as int8 values and scales under those same names (the offloading
loader keeps offloaded layers in int8 with it).
"""
