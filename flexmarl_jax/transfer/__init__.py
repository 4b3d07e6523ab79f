"""Location-agnostic state movement: the StateStore (device / host / Orbax storage) and packed transfer."""

from flexmarl_jax.transfer.store import TIERS, StateStore

__all__ = ["TIERS", "StateStore"]
