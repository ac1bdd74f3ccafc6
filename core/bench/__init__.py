"""Layer 7: measuring: the bench protocol, result files, accelgen compare's tables and charts."""
