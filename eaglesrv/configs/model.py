from __future__ import annotations

from dataclasses import dataclass

from eaglesrv.configs.errors import require

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run, and in what precision.

    dtype "auto": on CUDA, the checkpoint's own dtype, with float32 checkpoints run in
    bfloat16 (as SGLang and vLLM do); on the CPU, float32, because this CPU's float32
    matrix-vector products stream memory faster than bfloat16 ones (see README).
    """

    model_path: str | None = None  # None: the default model, SmolLM2-135M-Instruct
    tokenizer_path: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    context_length: int | None = None  # None: the model's max_position_embeddings
    download_dir: str | None = None
    revision: str | None = None
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    random_seed: int = 0  # dummy weights and unseeded requests

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(
            self.load_format in LOAD_FORMATS,
            f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}",
        )
        require(
            self.context_length is None or self.context_length >= 2,
            f"--context-length must be at least 2, got {self.context_length}",
        )
