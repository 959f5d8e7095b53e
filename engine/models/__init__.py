"""Models for the engine, each a small file composing engine.layers (models/llama.py: the Llama
family), their configs (models/config.py, torch-free: the simulated engine reads them too) and
the safetensors loader (models/loader.py; which share of each weight a tensor-parallel rank
reads is engine.layers.parallel's). A new architecture is a new file here and a line in the
loader's registry. Import from those modules: this package imports nothing, so reading a config
never loads torch.
"""
