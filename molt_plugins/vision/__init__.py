"""First-party vision modality: image processor, placeholder expansion, positions, wire images."""
