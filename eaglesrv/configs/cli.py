"""Engine flags, with SGLang's names, declared once: argparse and the configs come from here.

Each Flag names the config group and field it fills, so a flag, its help text and its
config field cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from eaglesrv.configs.cache import CacheConfig
from eaglesrv.configs.engine import EngineConfig
from eaglesrv.configs.model import DTYPES, LOAD_FORMATS, ModelConfig
from eaglesrv.configs.parallel import ParallelConfig
from eaglesrv.configs.runtime import ATTENTION_BACKENDS, DEVICES, RuntimeConfig
from eaglesrv.configs.scheduler import SCHEDULE_POLICIES, SchedulerConfig
from eaglesrv.configs.speculative import SpeculativeConfig

GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "runtime": RuntimeConfig,
    "parallel": ParallelConfig,
}


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    group: str  # key of GROUPS
    field: str  # field of that config dataclass
    help: str
    type: Any = None
    choices: tuple | None = None
    store_true: bool = False  # a switch that sets the field True
    store_false: bool = False  # a switch that sets the field False


def _optional_str(value: str) -> str | None:
    return None if value.lower() in ("", "none") else value


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag(("--model-path", "--model"), "model", "model_path",
         "Local Hugging Face directory, hub id, or .gguf file. Default: SmolLM2-135M-Instruct.", str),
    Flag(("--tokenizer-path",), "model", "tokenizer_path", "Tokenizer location, if not the model's.", str),
    Flag(("--load-format",), "model", "load_format",
         "Weight format; 'dummy' makes random weights for speed runs.", str, LOAD_FORMATS),
    Flag(("--dtype",), "model", "dtype", "Compute dtype; see README for what 'auto' picks.", str, DTYPES),
    Flag(("--context-length",), "model", "context_length", "Maximum tokens per sequence (prompt + output).", int),
    Flag(("--download-dir",), "model", "download_dir", "Cache directory for fetched models.", str),
    Flag(("--revision",), "model", "revision", "Hub revision (branch, tag or commit).", str),
    Flag(("--skip-tokenizer-init",), "model", "skip_tokenizer_init",
         "Do not load a tokenizer; requests must carry token ids.", store_true=True),
    Flag(("--served-model-name",), "model", "served_model_name", "Model name reported by the API.", str),
    Flag(("--random-seed",), "model", "random_seed", "Seed for dummy weights and unseeded requests.", int),
    Flag(("--page-size",), "cache", "page_size", "Tokens per KV-cache page.", int),
    Flag(("--max-total-tokens",), "cache", "max_total_tokens", "KV-cache pool size in tokens.", int),
    Flag(("--mem-fraction-static",), "cache", "mem_fraction_static",
         "Fraction of memory for weights and KV cache (KV pool sized from what is left).", float),
    Flag(("--disable-radix-cache",), "cache", "disable_radix_cache",
         "Do not keep the KV pages of earlier prompts for reuse (the prefix cache is on by default).",
         store_true=True),
    Flag(("--max-running-requests",), "scheduler", "max_running_requests", "Most requests decoding at once.", int),
    Flag(("--chunked-prefill-size",), "scheduler", "chunked_prefill_size",
         "Most tokens per forward pass; -1 disables chunked prefill.", int),
    Flag(("--schedule-policy",), "scheduler", "schedule_policy",
         "Order of admission: fcfs (arrival order) or lpm (longest cached prefix first).", str,
         choices=SCHEDULE_POLICIES),
    Flag(("--speculative-algorithm",), "speculative", "algorithm", "EAGLE3, or unset for plain decoding.",
         _optional_str),
    Flag(("--speculative-draft-model-path",), "speculative", "draft_model_path", "EAGLE-3 draft head.", str),
    Flag(("--speculative-num-steps",), "speculative", "num_steps", "Draft depth.", int),
    Flag(("--speculative-eagle-topk",), "speculative", "eagle_topk", "Draft branching per step.", int),
    Flag(("--speculative-num-draft-tokens",), "speculative", "num_draft_tokens",
         "Tree nodes verified per request, root included.", int),
    Flag(("--speculative-adaptive",), "speculative", "adaptive",
         "Choose per step between plain decoding, chains and trees up to the flags above, from measured costs "
         "and live acceptance (the default).", store_true=True),
    Flag(("--disable-speculative-adaptive",), "speculative", "adaptive",
         "Verify the tree the flags above describe at every step, as SGLang does.", store_false=True),
    Flag(("--device",), "runtime", "device", "Where to run.", str, DEVICES),
    Flag(("--attention-backend",), "runtime", "attention_backend",
         "Attention kernels: auto (on CUDA flashinfer, then triton, each checked at start-up against the torch "
         "reference and skipped if it fails; the C++ kernel on the CPU), torch (the reference), cpu, triton, "
         "flashinfer (a backend named here that fails its check stops start-up).", str, ATTENTION_BACKENDS),
    Flag(("--cuda-graph-max-bs",), "runtime", "cuda_graph_max_bs", "Largest batch captured in a CUDA graph.", int),
    Flag(("--disable-cuda-graph",), "runtime", "disable_cuda_graph", "Run every pass eagerly.", store_true=True),
    Flag(("--num-threads",), "runtime", "num_threads",
         "CPU threads for torch (per rank; default: torch's, divided among this node's tensor-parallel ranks).", int),
    Flag(("--tp-size", "--tensor-parallel-size"), "parallel", "tp_size",
         "Tensor-parallel ranks: the model's heads, rows and vocabulary split across this many GPUs (gloo ranks "
         "on the CPU).", int),
    Flag(("--nnodes",), "parallel", "nnodes", "Nodes the tensor-parallel ranks span (--tp-size / --nnodes each).", int),
    Flag(("--node-rank",), "parallel", "node_rank", "This node's index; node 0 serves HTTP.", int),
    Flag(("--dist-init-addr",), "parallel", "dist_init_addr",
         "HOST:PORT of node 0's rendezvous (torch.distributed's TCP store); needed with --nnodes above 1.", str),
    Flag(("--dist-timeout",), "parallel", "dist_timeout",
         "Seconds the ranks wait for each other in a collective or at the rendezvous before the server stops "
         "with an error.", float),
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every engine flag to `parser`, one argument group per config group."""
    groups = {name: parser.add_argument_group(f"{name} options") for name in GROUPS}
    for flag in ENGINE_FLAGS:
        default = _field_default(flag)
        dest = f"{flag.group}__{flag.field}"
        if flag.store_true or flag.store_false:  # two switches may share a field: both carry its default
            action = "store_true" if flag.store_true else "store_false"
            groups[flag.group].add_argument(*flag.names, dest=dest, action=action, default=default, help=flag.help)
            continue
        shown = f" (default: {default})" if default is not None else ""
        groups[flag.group].add_argument(
            *flag.names, dest=dest, type=flag.type, choices=flag.choices, default=default,
            help=flag.help + shown, metavar=None if flag.choices else flag.field.upper(),
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the validated EngineConfig from parsed flags (raises ConfigError)."""
    values: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
    for flag in ENGINE_FLAGS:
        values[flag.group][flag.field] = getattr(args, f"{flag.group}__{flag.field}")
    return EngineConfig(**{name: cls(**values[name]) for name, cls in GROUPS.items()})


def parse_engine_config(argv: Sequence[str] | None = None, prog: str | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser(prog=prog)
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv))


def _field_default(flag: Flag) -> Any:
    for f in dataclasses.fields(GROUPS[flag.group]):
        if f.name == flag.field:
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()
    raise KeyError(f"{flag.group} config has no field {flag.field}")
