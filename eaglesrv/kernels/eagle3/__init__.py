"""The EAGLE-3 step's bookkeeping on the device, batched over requests.

Each operation is a Triton kernel wrapped as a `torch.library.custom_op` (so a CUDA-graph
capture records one op) beside a torch reference that is its test oracle. The public
functions pick the kernel when Triton can run on the tensors' device
(triton_support.triton_usable) and the reference otherwise, so the CPU engine needs no
interpreter. Layouts are in each module's docstring.

    new_slots.new_token_slots        cache slots of a pass's new tokens, from a block table
    acceptance.greedy_accept         greedy acceptance of every tree (sampling stays in torch)
    compaction.compact_kv            the accepted nodes' K/V moved next to their roots

The draft tree itself is built by engine/eagle3/tree.py's TreeBuilder, plain torch ops that
stay on the device.

Every operation is two modules: `<name>.py` (layouts, the public function, the reference;
imports no Triton, so the CPU engine runs where Triton is not installed) and
`<name>_kernel.py` (the kernel, its custom op and its SM90_BUILDS), imported on first use.
"""

from eaglesrv.kernels.eagle3.acceptance import greedy_accept, greedy_accept_reference
from eaglesrv.kernels.eagle3.compaction import compact_kv, compact_kv_reference
from eaglesrv.kernels.eagle3.new_slots import new_token_slots, new_token_slots_reference

__all__ = [
    "compact_kv", "compact_kv_reference", "greedy_accept",
    "greedy_accept_reference", "new_token_slots", "new_token_slots_reference",
]
