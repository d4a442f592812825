"""The run's timeouts and thresholds (the MIXTRAIN_* env-var/default pairs of _constants.py), read once when a fit
starts into one frozen object that the driver's parts are handed: a variable changed mid-run changes nothing, and
a test sets them in the environment (or builds a Tunables) before it starts a run."""

from __future__ import annotations

from dataclasses import dataclass

from mixtrain import _constants as c


@dataclass(frozen=True, kw_only=True)
class Tunables:
    rendezvous_timeout_s: float = c.RENDEZVOUS_TIMEOUT_S[1]
    collective_timeout_s: float = c.COLLECTIVE_TIMEOUT_S[1]
    round_timeout_s: float = c.ROUND_TIMEOUT_S[1]
    round_target_s: float = c.ROUND_TARGET_S[1]
    rebalance_threshold: float = c.REBALANCE_THRESHOLD[1]
    exclude_gain: float = c.EXCLUDE_GAIN[1]
    leave_out_payback_s: float = c.LEAVE_OUT_PAYBACK_S[1]
    bucket_bytes: int = int(c.BUCKET_MB[1] * 2**20)
    store_pages_bytes: int = int(c.STORE_PAGES_MB[1] * 2**20)
    lost_grace_s: float = c.LOST_GRACE_S[1]
    min_link_bytes_per_s: float = c.MIN_LINK_MBPS[1] * 1e6
    failure_window_s: float = c.FAILURE_WINDOW_S[1]
    setup_extra_s: float = c.SETUP_EXTRA_S[1]
    placement_timeout_s: float = c.PLACEMENT_TIMEOUT_S[1]
    shutdown_wait_s: float = c.SHUTDOWN_WAIT_S[1]
    renumber_timeout_s: float = c.RENUMBER_TIMEOUT_S[1]
    keep_workers_max_fits: float = c.KEEP_WORKERS_MAX_FITS[1]

    @classmethod
    def from_env(cls) -> Tunables:
        """Each value from its MIXTRAIN_* variable, or its default; a bad value is an error naming the variable."""
        return cls(
            rendezvous_timeout_s=c.env_float(c.RENDEZVOUS_TIMEOUT_S),
            collective_timeout_s=c.env_float(c.COLLECTIVE_TIMEOUT_S),
            round_timeout_s=c.env_float(c.ROUND_TIMEOUT_S),
            round_target_s=c.env_float(c.ROUND_TARGET_S),
            rebalance_threshold=c.env_float(c.REBALANCE_THRESHOLD),
            exclude_gain=c.env_float(c.EXCLUDE_GAIN),
            leave_out_payback_s=c.env_float(c.LEAVE_OUT_PAYBACK_S, zero_allowed=True),
            bucket_bytes=int(c.env_float(c.BUCKET_MB) * 2**20),
            store_pages_bytes=int(c.env_float(c.STORE_PAGES_MB, zero_allowed=True) * 2**20),
            lost_grace_s=c.env_float(c.LOST_GRACE_S),
            min_link_bytes_per_s=c.env_float(c.MIN_LINK_MBPS) * 1e6,
            failure_window_s=c.env_float(c.FAILURE_WINDOW_S),
            setup_extra_s=c.env_float(c.SETUP_EXTRA_S),
            placement_timeout_s=c.env_float(c.PLACEMENT_TIMEOUT_S),
            shutdown_wait_s=c.env_float(c.SHUTDOWN_WAIT_S),
            renumber_timeout_s=c.env_float(c.RENUMBER_TIMEOUT_S),
            keep_workers_max_fits=c.env_float(c.KEEP_WORKERS_MAX_FITS),
        )

    def transfer_s(self, num_bytes: float) -> float:
        """Deadline for moving `num_bytes` between processes (a state, a checkpoint, the link measurement): the
        collective timeout plus the time the slowest allowed link needs, so a big model on Wi-Fi is not cut off."""
        return self.collective_timeout_s + num_bytes / self.min_link_bytes_per_s

    @property
    def setup_s(self) -> float:
        """How long building, loading and probing a worker may take (it may compile kernels)."""
        return self.rendezvous_timeout_s + self.setup_extra_s

    @property
    def lost_after_s(self) -> float:
        """After a worker died: how long the others get to answer before they too count as lost."""
        return self.collective_timeout_s + self.lost_grace_s
