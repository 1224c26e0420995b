"""Stage 6, the layer: the Experts interface, the modular kernel (PrepareFinalize × Experts), the all2all
dispatchers with expert placement, routing, and build (oracle → checkpoint → formats → kernel).
May import: every stage below it."""
