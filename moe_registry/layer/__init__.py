"""Stage 5, the layer: the Experts interface, the modular kernel (PrepareFinalize × Experts) and
build (oracle → checkpoint → converter → kernel). May import: every stage below it."""
