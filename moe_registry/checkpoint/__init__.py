"""Stage 4, the checkpoint: safetensors headers by name and one MoE layer's tensors as stored, checked
against the scheme the oracle chose. May import: oracle, situation, spec, core."""
