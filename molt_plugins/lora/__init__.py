"""First-party LoRA adapters (peft): the ``lora`` adapter behind the trainer's adapter hook."""
