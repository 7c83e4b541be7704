"""Plain-Python continuous batching: requests, queues, token budget, KV pages, preemption.

No torch here: the scheduler hands the engine a ScheduledBatch and takes back the
sampled tokens, so it can be tested with fake model outputs.
"""

from eaglesrv.scheduler.batch import RequestOutput, ScheduledBatch, SequenceResult, SequenceWork
from eaglesrv.scheduler.page_allocator import OutOfPages, PageAllocator
from eaglesrv.scheduler.request import FinishReason, Request, RequestStatus
from eaglesrv.scheduler.scheduler import (
    PLAIN_DECODING,
    DecodeDemand,
    FixedDemand,
    NoProgress,
    RequestRejected,
    Scheduler,
)

__all__ = [
    "PLAIN_DECODING",
    "DecodeDemand",
    "FixedDemand",
    "NoProgress",
    "FinishReason",
    "OutOfPages",
    "PageAllocator",
    "Request",
    "RequestOutput",
    "RequestRejected",
    "RequestStatus",
    "ScheduledBatch",
    "SequenceResult",
    "Scheduler",
    "SequenceWork",
]
