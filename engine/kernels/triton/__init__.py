"""Triton kernels for the GPU executor, one module per job, each with a pure-torch reference.

Every kernel loads its inputs, converts them to float32, computes and converts back on store:
the Triton interpreter (TRITON_INTERPRET=1, how the CPU test suite runs them) cannot compute in
bfloat16. Importing a kernel module binds it to the interpreter or to the GPU compiler for the
life of the process, so that variable must be set before the first import. These modules never
allocate the KV cache and never keep state between calls.
"""
