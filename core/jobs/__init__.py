"""Layer 7: long jobs with files: resumable completion of prompts and datasets, the output lock, accelgen shard."""
