"""Stage 4, the model on disk: config.json through the family specs, the Situation the user
described, one layer's checkpoint tensors, and routing. May import: formats, oracle, spec, core."""
