"""The token pipeline: data sources, token files, shards and the batch sampler. Imports
nothing of train/, fit/ or pretrain/."""
