"""Layer 6: long jobs with files: resumable completion of prompts and datasets, the output lock, accelgen shard."""
