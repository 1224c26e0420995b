"""Stage 3, the oracle: scheme detection and scoping, kernel predicates, selection, the verdicts and the
Report, and rendering. Pure: it probes nothing and imports no kernel code. May import: situation, spec, core."""
