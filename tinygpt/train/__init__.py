"""Training: data and token caches, optimizers, several GPUs, memory, the probe, the one Trainer,
pretraining end to end."""
