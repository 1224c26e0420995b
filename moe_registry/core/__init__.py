"""Stage 0, shared by every stage: the vocabulary, QuantKeys, errors, what every check returns (Check with a
Reason) and the guards on untrusted input. Imports nothing else of moe_registry."""
