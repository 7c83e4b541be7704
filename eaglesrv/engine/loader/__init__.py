"""Model loading: resolve a path, hub id, GGUF file or the default model to a ModelSource."""

from .default_model import DEFAULT_MODEL_NAME, default_model_path
from .errors import ModelLoadError
from .resolve import LOAD_FORMATS, resolve_model
from .source import ModelSource, SliceChooser, TensorSlice, WeightStream

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LOAD_FORMATS",
    "ModelLoadError",
    "ModelSource",
    "SliceChooser",
    "TensorSlice",
    "WeightStream",
    "default_model_path",
    "resolve_model",
]
