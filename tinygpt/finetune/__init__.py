"""Finetuning with LoRA and QLoRA (peft, bitsandbytes) on the shared Trainer: instruction data, recipes, the run."""
