"""Model code for the engine: configs, the Llama-family model, and the safetensors loader."""

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import MODEL_REGISTRY, load_model

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "ModelConfig", "load_model"]
