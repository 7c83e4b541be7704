"""Train EAGLE-3 draft heads: `python -m eaglesrv.train_eagle3 --help`.

Module map:
    config.py      TrainConfig: every setting of a run
    data.py        ShareGPT (first 8,000 only) -> chat template -> tokens + reply mask
    distill.py     self-distillation: the target rewrites the assistant turns
    vocab.py       the draft vocabulary by reply-token frequency (d2t / t2d)
    features.py    the frozen target's features and hidden states, cached on disk
    ttt.py         the training-time-test unroll, its attention pattern and loss
    trainer.py     batches, optimizer, schedule, checkpoints
    checkpoint.py  what --resume restores
    pipeline.py    one run, start to finish
"""

from eaglesrv.train_eagle3.config import TrainConfig
from eaglesrv.train_eagle3.pipeline import run

__all__ = ["TrainConfig", "run"]
