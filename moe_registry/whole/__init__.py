"""Stage 7, whole models: a transformers model built from a checkpoint's own config.json whose MoE layers'
routed experts run on the kernels the oracle picks per layer (transformers is the optional extra
``moe-registry[transformers]``; nothing below this stage imports it). May import: every stage below it."""
