"""Layer 6: fine-tuned LoRA adapters over the loaded model (``--lora``), the whole story in one place.

``adapter_files`` reads one PEFT adapter (a folder or a Hub id) and refuses what accelgen cannot run (its config's
fields checked by ``adapter_config``); ``adapter_set`` holds a run's adapters and checks them against the model before it
loads. Named adapters, chosen row by row, live in fixed-size device buffers of every adapted layer (``lora_layer``: each token's own adapter's low-rank product added to
the layer's output, in shapes that never change), over which ``resident`` replaces the loaded model's layers and copies
adapters into buffer slots as the scheduler asks (the generator reaches it through
``accelgen.model.loaded_model.AdapterBuffers``). One adapter given without a name is added into the weights at load
(``merge``). ``figures`` says what they did, for the summary line and result files.
"""
