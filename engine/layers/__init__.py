"""The building blocks models compose (engine/models/ files are small because of them): linear
layers (dense, oneDNN-packed, bfloat16 tiles, int8/int4) and their tensor-parallel forms, norms,
rotary embeddings, activations and the attention front. Import from the modules: this package
imports nothing. Layers never read files (the loader fills their parameters) and never import a
model.
"""
