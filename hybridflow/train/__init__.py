"""Training: typed config, the step loop, metrics, checkpoints and the SFT warm start."""
