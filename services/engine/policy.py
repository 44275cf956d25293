"""Which scheduler class serves a scheduling policy (as vLLM's ``get_scheduler_cls``)."""
from __future__ import annotations

from .block_manager import BlockManager
from .scheduler import Scheduler, SchedulerConfig
from .static_batch import StaticScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {"continuous": Scheduler, "static": StaticScheduler}


def create_scheduler(config: SchedulerConfig, block_manager: BlockManager) -> Scheduler:
    """The scheduler for ``config.policy``. Raises ``ValueError`` naming ``policy``."""
    cls = SCHEDULERS.get(config.policy)
    if cls is None:
        raise ValueError(f"policy: {config.policy!r} is not one of {tuple(SCHEDULERS)}")
    return cls(config, block_manager)
