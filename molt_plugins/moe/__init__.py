"""First-party MoE routing record/replay (R3) behind the replay-backend protocol."""
