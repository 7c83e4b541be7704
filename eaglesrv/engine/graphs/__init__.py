"""Graphs: capture a forward step once per batch size and replay it, CUDA graphs on a GPU.

Parts
- `capture.py`: the mechanism's interface. `CaptureMechanism.capture(step)` warms a
  step up and captures one run of it on the tensors it closes over; the `CapturedGraph`
  replays it and holds its static outputs. `capture_mechanism_for(device)` picks one.
- `cuda_capture.py`: over `torch.cuda.CUDAGraph` (side-stream warm-up, one memory pool
  shared by every graph of a mechanism).
- `traced_capture.py` and `graph_safety.py`: the CPU stand-in with CUDA-graph semantics.
  It records the ops of one run and replays exactly those on the same tensors, so Python
  control flow and Python scalars freeze as in a real graph; it refuses host syncs,
  data-dependent shapes and random-number ops with an error naming the op. Graph code is
  tested on the CPU against eager with it.
- `ladder.py`: the batch sizes captured (1, 2, 4, 8, then steps of 8 up to
  `--cuda-graph-max-bs`) and the one a batch pads to.
- `runner.py`: `GraphRunner`: static input buffers, one graph per rung, padding rows
  written with caller-given values (a dummy page or slot), outputs cut to the real rows;
  batches above the top rung and `--disable-cuda-graph` run eagerly.
- `decode_step.py`: `DecodeGraphs`, the target's decode step (token, cached length and
  block-table row per request in; logits out) on a `GraphRunner`, with the KV pool's
  padding page for padding rows. `PlainRunner` replays it for decode-only steps; the
  engine builder captures it at start-up on CUDA (`--cuda-graph-max-bs`,
  `--disable-cuda-graph`).

Built on these, in EAGLE-3's own package: `engine/eagle3/graphs.py`, `Eagle3Graphs`, an
EAGLE-3 server's graphs on one shared mechanism: the tree step (the draft passes that grow
the configured tree, its masks, and the target's verification pass), the plain step
(decode with the draft's feature layers) and the draft extend (the committed tokens padded
to a fixed width). Acceptance and K/V compaction run on the host between the tree step and
the extend.

Random numbers under a graph
A graph contains no random-number op (the stand-in refuses them). Sampling draws from
per-request uniforms that the host derives from (seed, step) with splitmix64
(`sampler.request_uniforms`), and those uniforms are a graph input, copied into a static
buffer every step like the token ids; padding rows get any value in [0, 1). The draw
itself (`sampler.draw_from_probs`, an inverse CDF) is tensor work a graph can hold. This
keeps seeded sampling reproducible whatever else is in the batch, identical on the CPU and
on CUDA, and identical between a plain step and a speculative one, without the CUDA
generator's graph-safe offset bookkeeping. Per-request sampling parameters (temperature,
top-p, top-k, penalties) must likewise reach a graph as per-row tensors, never as Python
values read during capture; the sampler as written still branches on them in Python and
reads ids back with `.tolist()`, so it runs outside the graph until that is done.

Adaptive speculation's shapes: the configured tree and plain steps replay, the rest is eager
A graph is fixed to the shapes it was captured with, and each tree shape changes how many
rows each request sends through the target pass (its nodes) and through each draft pass
(its topk). The default speculative config (5 steps, topk 8, 32 nodes) gives the policy
46 candidate shapes with 14 distinct node counts (`tree_shape.candidate_shapes`), so
"one graph per shape per rung" is about a thousand graphs at `--cuda-graph-max-bs` 160:
too many to capture at start-up or keep in memory. What is captured, per rung:
- the configured tree, for steps in which every request speculates with it (every decode
  step of a static server; an adaptive server's steps at low load, where it picks the
  largest tree);
- the plain step, for steps in which no request speculates (an adaptive server under
  load, which is where a graph's saving of launch overhead matters most on a GPU);
- the draft extend, which any step's extends use when every entry fits its width.
An adaptive step with a smaller tree, or with some requests speculating and others not,
runs eagerly. The next candidate, if those steps turn out common on a GPU: key the target
pass by its padded row count instead of (shape, batch size), since positions, slots, the
tree mask and the row-to-request map are inputs, so any mix of plain rows and tree rows
with the same padded count could replay one graph; draft passes keyed by (batch size,
topk).
"""

from eaglesrv.engine.graphs.capture import CapturedGraph, CaptureMechanism, GraphCaptureError, capture_mechanism_for
from eaglesrv.engine.graphs.ladder import cuda_graph_batch_sizes, padded_batch_size
from eaglesrv.engine.graphs.runner import GraphRunner, StaticInput

__all__ = [
    "CaptureMechanism",
    "CapturedGraph",
    "GraphCaptureError",
    "GraphRunner",
    "StaticInput",
    "capture_mechanism_for",
    "cuda_graph_batch_sizes",
    "padded_batch_size",
]
