"""Layer 1: the plugin contract (hooks and the Accelerator base class), the plugin manager, the checked registry."""
