"""Strategy names to classes (one place, so the strategies can import the base without a cycle)."""

from __future__ import annotations

from mixtrain.comm.local_sgd import LocalSGDStrategy
from mixtrain.comm.ps import ParameterServerStrategy
from mixtrain.comm.strategy import AllReduceStrategy, SyncStrategy
from mixtrain.config import StrategyConfig

STRATEGIES: dict[str, type[SyncStrategy]] = {
    "allreduce": AllReduceStrategy,
    "ps": ParameterServerStrategy,
    "ps-async": ParameterServerStrategy,
    "local-sgd": LocalSGDStrategy,
}


def make(config: StrategyConfig) -> SyncStrategy:
    return STRATEGIES[config.name](config)
