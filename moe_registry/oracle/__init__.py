"""Stage 2, the oracle: the contract (Situation, Check/Reason, verdicts, Report), the runtime
situation, scheme detection and scoping, kernel predicates, selection and rendering. Pure: it
probes nothing and imports no kernel code. May import: spec, core."""
