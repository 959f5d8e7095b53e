"""Model code for the engine: configs (models/config.py, torch-free: the simulated engine reads
them too), the Llama-family model (models/llama.py) and the safetensors loader (models/loader.py).
Import from those modules: this package imports nothing, so reading a config never loads torch.
"""
