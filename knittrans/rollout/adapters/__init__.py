"""Pure conversions from engine outputs (transformers ``generate()``, vLLM ``RequestOutput``) to groups."""
