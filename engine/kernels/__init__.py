"""Folio's own kernels, below the layers and the attention backends, in two rooms:

- `cpu/`: C++ for x86 CPUs (AVX2 int8/int4 matmuls for float32 activations, paged attention,
  linears over oneDNN-packed weights and, with AVX-512 BF16, over Folio's bfloat16 tiles), built
  once per machine as one torch extension, and the capabilities of the CPU they run on;
- `triton/`: the GPU's kernels (RMSNorm, rotary, SiLU-and-mul, KV-cache writes, paged attention,
  sampling), each with a pure-torch reference, tested under the Triton interpreter.

Kernels compute; they never choose which of them runs (engine.layers.linear and the attention
backends do) and never import the layers, the models or the attention backends above them.
"""
