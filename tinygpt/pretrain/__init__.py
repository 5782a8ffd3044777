"""Pretraining end to end: options, where the weights start, what a mirror may supply, and
the run itself (`run_pretrain.pretrain`)."""
