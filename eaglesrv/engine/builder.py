"""Assemble an engine from its config, in one place: device and dtype, the target model and
tokenizer, the EAGLE-3 head, the KV pools, the attention backend, the step runner, the
adaptive policy and the scheduler. Engine.__init__ calls build_engine once.

    config -> device, dtype (placement.py) -> tensor-parallel group (parallel/), with more than one rank
           -> target model (this rank's shard), tokenizer (loader/)
           -> draft head (eagle3/head_io.py)  -> attention backend, checked on the device
           -> KV pool size (placement.kv_pool_pages, less what the graphs keep)
           -> KV pools -> graphs, captured (CUDA): plain decoding's, or EAGLE-3's tree step and
              draft extend -> runner (PlainRunner | Eagle3Runner)
           -> scheduler (asks the runner what a decode needs)
           -> adaptive: cost model measured on pages borrowed from the scheduler
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from eaglesrv.configs import EngineConfig
from eaglesrv.configs.runtime import DEFAULT_CUDA_GRAPH_MAX_BS
from eaglesrv.engine.adaptive.backlog import FeaturePool
from eaglesrv.engine.adaptive.calibrate import load_or_measure
from eaglesrv.engine.adaptive.controller import AdaptiveSpeculation
from eaglesrv.engine.eagle3.draft_model import Eagle3DraftModel
from eaglesrv.engine.eagle3.eagle3_runner import Eagle3Runner
from eaglesrv.engine.eagle3.graphs import Eagle3Graphs
from eaglesrv.engine.eagle3.head_io import load_draft_head
from eaglesrv.engine.grammar_masks import GrammarMatchers
from eaglesrv.engine.graphs.decode_step import DecodeGraphs, decode_graph_bytes
from eaglesrv.engine.kv_cache import KVPool
from eaglesrv.engine.loader import resolve_model
from eaglesrv.engine.model.arch import ModelArch
from eaglesrv.engine.model.cpu_layout import wants_input_major
from eaglesrv.engine.model.llama import LlamaForCausalLM
from eaglesrv.engine.model.sharding import check_divisible
from eaglesrv.engine.parallel.group import TensorParallel, connect
from eaglesrv.engine.parallel.ranks import SINGLE, RankPlacement
from eaglesrv.engine.placement import EngineSetupError, kv_pool_pages, resolve_device, resolve_dtype
from eaglesrv.engine.plain_runner import PlainRunner
from eaglesrv.engine.step_runner import StepRunner
from eaglesrv.engine.tree_shape import TreeShape
from eaglesrv.heads import DEFAULT_MODEL_HEAD, default_model_head
from eaglesrv.kernels.attention.base import AttentionBackend
from eaglesrv.kernels.attention.self_check import select_attention_backend
from eaglesrv.scheduler import Scheduler
from eaglesrv.utils.malloc import keep_freed_memory

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    arch: ModelArch
    model: LlamaForCausalLM
    tokenizer: Any | None  # a transformers tokenizer, or None (--skip-tokenizer-init, dummy models)
    eos_token_ids: frozenset[int]
    max_context_len: int  # positions a sequence may reach: the model's, capped by the draft's table
    runner: StepRunner
    scheduler: Scheduler
    tp: TensorParallel  # this process's place in the tensor-parallel group (one rank: a pass-through)


def build_engine(config: EngineConfig, placement: RankPlacement = SINGLE) -> EngineParts:
    """The engine of one process: with tensor parallelism, of one rank (every rank calls this
    with the same config; rank 0's scheduler is the one that schedules)."""
    device = _rank_device(resolve_device(config.runtime), placement)
    _set_threads(config, device, placement)
    if device.type == "cpu":
        keep_freed_memory()
    spec = config.speculative
    draft_path = _draft_path(config) if spec.enabled else None  # before loading, not after
    source = resolve_model(
        config.model.model_path, config.model.load_format, config.model.tokenizer_path,
        config.model.download_dir, config.model.revision,
    )
    logger.info("Loading %s", source.description)
    arch = ModelArch.from_hf_config(source.hf_config)
    check_divisible(arch, placement.size)  # before the rendezvous: every rank refuses alike, none waits
    tp = connect(placement, device, config.parallel.dist_timeout)
    dtype = resolve_dtype(config.model, source.hf_config, device)
    model = _build_model(arch, dtype, device, source.iter_weights, config.model.random_seed, tp)
    load_tokenizer = None if config.model.skip_tokenizer_init else source.load_tokenizer
    # Rank 0's: another rank needs one only for grammars, and loads it at the first (GrammarMatchers).
    tokenizer = load_tokenizer() if load_tokenizer is not None and tp.is_leader else None
    max_context_len = min(config.model.context_length or arch.max_context_len, arch.max_context_len)

    draft = None
    if spec.enabled:
        # The head runs whole on every rank (replicated): a one-layer pass costs less than the
        # all-reduces a sharded one would add to each of its several passes per step.
        draft = load_draft_head(
            draft_path, arch, model.full_embedding(), dtype, device,
            random_seed=config.model.random_seed if draft_path is None else None,
        )
        # Every position a request may reach must be in both rotary tables.
        max_context_len = min(max_context_len, draft.config.arch.max_position_embeddings)
    adaptive = spec.enabled and spec.adaptive
    feature_width = draft.fc.in_features if adaptive else 0  # a row of the adaptive feature pool
    page_size = config.cache.page_size
    shard = model.shard  # this rank's heads: its KV pool and attention kernels hold only those
    head_shapes = [(a.num_heads, a.num_kv_heads, a.head_dim) for a in (shard, draft.config.arch if draft else None)
                   if a]
    attention = select_attention_backend(config.runtime.attention_backend, page_size, device, head_shapes, dtype)
    graph_batch = _graph_batch_size(config, device, attention)
    max_pages = -(-max_context_len // page_size)  # the widest block table a graph takes
    tree = TreeShape.from_config(spec) if draft is not None else None
    # What the graphs keep: the target's pass at the top rung, over every tree node with EAGLE-3
    # (its draft passes and extend are far smaller).
    # Every rank must have as many pages (rank 0's scheduler hands them out for all).
    num_pages = tp.smallest(kv_pool_pages(
        config.cache, shard, dtype, device, _weight_bytes(model, draft),
        extra_bytes_per_token=(KVPool.bytes_per_token(draft.config.arch, dtype) if draft is not None else 0)
        + FeaturePool.bytes_per_token(feature_width, dtype),
        reserved_bytes=decode_graph_bytes(shard, dtype, graph_batch * (tree.nodes if tree else 1), attention,
                                          max_pages * page_size) if graph_batch else 0,
        ranks_sharing_host=placement.ranks_per_node,
    ))
    kv = KVPool(shard, num_pages, page_size, dtype, device)
    if draft is None:
        graphs = None if graph_batch is None else DecodeGraphs(model, kv, attention, device, graph_batch, max_pages)
        runner: StepRunner = PlainRunner(model, kv, attention, device, _captured(graphs, device, "decode graphs"))
    else:
        draft_kv = KVPool(draft.config.arch, num_pages, page_size, dtype, device)
        graphs = None if graph_batch is None else Eagle3Graphs(
            model, draft, kv, draft_kv, attention, device, tree, draft.config.capture_layers(arch.num_layers),
            graph_batch, max_pages)
        runner = Eagle3Runner(model, draft, kv, draft_kv, attention, device, spec,
                              graphs=_captured(graphs, device, "EAGLE-3 tree-step and draft-extend graphs"))
    eos_token_ids = tp.leader_value(lambda: _eos_ids(arch, source.generation_config, tokenizer), startup=True)
    if load_tokenizer is not None:
        runner.grammars = GrammarMatchers(load_tokenizer if tokenizer is None else lambda: tokenizer, arch.vocab_size,
                                          eos_token_ids)
    scheduler = Scheduler(config.scheduler, num_pages, page_size, demand=runner,
                          prefix_cache=not config.cache.disable_radix_cache)
    if adaptive:
        costs = load_or_measure(runner, scheduler.pages, config.scheduler.max_running_requests)
        features = FeaturePool.allocate(num_pages, page_size, feature_width, dtype, device)
        runner.adaptive = AdaptiveSpeculation(runner.largest, costs, features)
    if draft is not None:
        logger.info(
            "EAGLE-3, %s: steps %d, topk %d, %d tree nodes%s; features from target layers %s", runner.mode,
            spec.num_steps, spec.eagle_topk, runner.num_nodes,
            " (the largest a step may use)" if adaptive else " (every step)", runner.capture_layers,
        )
    logger.info(
        "Engine ready: %s, %d layers, %s on %s, context %d, attention %s%s",
        arch.family, arch.num_layers, dtype, device, max_context_len, attention.name,
        f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "",
    )
    return EngineParts(device, dtype, arch, model, tokenizer, eos_token_ids, max_context_len, runner, scheduler, tp)


def _rank_device(device: torch.device, placement: RankPlacement) -> torch.device:
    """Each rank of a node on its own GPU (local rank); CPU ranks share the host."""
    if device.type != "cuda" or placement.size == 1:
        return device
    torch.cuda.set_device(placement.local_rank)
    return torch.device("cuda", placement.local_rank)


def _set_threads(config: EngineConfig, device: torch.device, placement: RankPlacement) -> None:
    """--num-threads, or on the CPU with several ranks here, the cores shared among them."""
    if config.runtime.num_threads:
        torch.set_num_threads(config.runtime.num_threads)
    elif device.type == "cpu" and placement.ranks_per_node > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // placement.ranks_per_node))


def _graph_batch_size(config: EngineConfig, device: torch.device, attention: AttentionBackend) -> int | None:
    """The largest batch the decode steps capture a graph for, or None for no graphs: they
    run on CUDA unless --disable-cuda-graph (on the CPU only for tests, via the stand-in)."""
    runtime = config.runtime
    if runtime.disable_cuda_graph or not (device.type == "cuda" or runtime.graphs_on_cpu):
        return None
    if not attention.graph_safe:
        logger.warning("the %s attention backend cannot run in a graph: decoding runs eagerly", attention.name)
        return None
    return min(runtime.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, config.scheduler.max_running_requests)


def _captured(graphs, device: torch.device, what: str):
    """The graphs (DecodeGraphs or Eagle3Graphs), captured, or None."""
    if graphs is None:
        return None
    started = time.monotonic()
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    graphs.capture()
    used = f", {(torch.cuda.memory_reserved(device) - before) / 2**30:.2f} GiB" if device.type == "cuda" else ""
    logger.info("Captured %s for batch sizes %s in %.1f s%s", what, graphs.batch_sizes, time.monotonic() - started,
                used)
    return graphs


def _build_model(arch: ModelArch, dtype: torch.dtype, device: torch.device, iter_weights, seed: int,
                 tp: TensorParallel):
    started = time.monotonic()
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, tp)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb.reset_tables()  # to_empty left the non-persistent tables blank
    if iter_weights is None:
        model.init_dummy_weights(seed)
    elif tp.size == 1:
        model.load_weights(iter_weights())
    else:
        model.load_weights(iter_weights(model.checkpoint_slice))  # this rank's slices alone
    if wants_input_major(dtype, device):
        model.use_input_major_weights()
    logger.info("Weights ready in %.1f s", time.monotonic() - started)
    return model.eval()


def _weight_bytes(model: LlamaForCausalLM, draft: Eagle3DraftModel | None) -> int:
    modules = [model] if draft is None else [model, draft]
    return sum(p.numel() * p.element_size() for module in modules for p in module.parameters())


def _draft_path(config: EngineConfig) -> str | None:
    """The head to load: the one named, the shipped one for the default model, or None
    (a random head) for dummy speed runs."""
    if config.speculative.draft_model_path is not None or config.model.load_format == "dummy":
        return config.speculative.draft_model_path
    if config.model.model_path is None:
        head = default_model_head()
        if head is None:
            raise EngineSetupError(
                f"the default model's EAGLE-3 head is missing from this install ({DEFAULT_MODEL_HEAD}); "
                "reinstall eaglesrv or pass --speculative-draft-model-path"
            )
        logger.info("EAGLE-3 head: the shipped one for the default model, %s", head)
        return str(head)
    raise EngineSetupError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")


def _eos_ids(arch: ModelArch, generation_config: dict[str, Any], tokenizer) -> frozenset[int]:
    ids = set(arch.eos_token_ids)
    gen_eos = generation_config.get("eos_token_id")
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
