"""Stage 2, the situation: what the user points at (config.json through the family specs, a runtime file,
flags) and what this machine has, as the Situation the oracle decides for. May import: spec, core."""
