"""Layer 0: what every layer shares: errors, the settings handed down, value ranges, prompts, host memory, output files."""
