"""Strategy names to classes, for the worker (one place, so the strategies can import the base without a cycle;
here, above comm/ and shard/, because it names the strategies of both)."""

from __future__ import annotations

from mixtrain.comm.local_sgd import LocalSGDStrategy
from mixtrain.comm.ps import ParameterServerStrategy
from mixtrain.comm.strategy import AllReduceStrategy, SyncStrategy
from mixtrain.config import StrategyConfig
from mixtrain.shard.sliced import SlicedStrategy

STRATEGIES: dict[str, type[SyncStrategy]] = {
    "allreduce": AllReduceStrategy,
    "ps": ParameterServerStrategy,
    "ps-async": ParameterServerStrategy,
    "local-sgd": LocalSGDStrategy,
}


def make(config: StrategyConfig, shard: str = "none") -> SyncStrategy:
    """The strategy `config` names; with gradients or weights sliced (ScalingConfig.shard), all-reduce's math
    through shard/sliced.py."""
    if shard in ("gradients", "full"):
        assert config.name == "allreduce", "check_together refuses sliced state with other strategies"
        return SlicedStrategy(config, "full" if shard == "full" else "gradients")
    return STRATEGIES[config.name](config)
