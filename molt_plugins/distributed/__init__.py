"""First-party FSDP2 trainer backend (``trainer.world_size > 1``) and its distributed checkpoints."""
