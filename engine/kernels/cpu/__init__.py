"""Folio's C++ kernels for x86 CPUs (the .cpp and .h files here), built and loaded as one torch
extension by `extension.py`, and `capabilities.py`, what this CPU and those kernels can do,
probed once per process. Nothing here chooses a kernel for a layer: engine.layers.linear and
the torch attention backend read the capabilities and choose.
"""
