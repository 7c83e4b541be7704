from __future__ import annotations

from dataclasses import dataclass

from eaglesrv.configs.errors import require

DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flashinfer")
DEFAULT_CUDA_GRAPH_MAX_BS = 160


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how forward passes run."""

    device: str = "auto"  # auto: cuda when available, else cpu
    # auto: on CUDA the first of flashinfer, triton, torch that passes its start-up check;
    # on the CPU cpu when it builds, else torch (kernels/attention/self_check.py).
    attention_backend: str = "auto"
    cuda_graph_max_bs: int | None = None  # None: DEFAULT_CUDA_GRAPH_MAX_BS, within --max-running-requests
    disable_cuda_graph: bool = False
    # Graphs on the CPU, through the stand-in with CUDA-graph semantics: slower than eager,
    # it exists so that tests run graph code without a GPU. Not a command-line flag.
    graphs_on_cpu: bool = False
    num_threads: int | None = None  # CPU threads for torch; None keeps torch's default

    def __post_init__(self) -> None:
        require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
        )
        require(
            self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
            f"--cuda-graph-max-bs must be at least 1, got {self.cuda_graph_max_bs}",
        )
