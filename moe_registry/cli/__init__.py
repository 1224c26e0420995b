"""Stage 8, the command line: verbs, ``run`` and the support matrix. May import every stage."""
