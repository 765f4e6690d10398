"""Scheduler: requests, configs, token budget, KV block pool, prefix cache.

Never imports torch: it plans work, the runner does it.
"""

from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler

__all__ = [
    "CacheConfig", "CachedRequestData", "EngineCoreOutput", "ModelRunnerOutput",
    "NewRequestData", "Request", "RequestStatus", "SamplingParams", "Scheduler",
    "SchedulerConfig", "SchedulerOutput",
]
