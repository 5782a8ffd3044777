"""The training engine: the one Trainer, its step, optimizers, several GPUs, callbacks, time
budgets, stopping, start-up and the compile cache."""
