"""Settings views for tests that build components directly: the benchmarks' helpers (one definition), each the
view of `RunConfig()` built by the library's own builder with the fields a test needs replaced. The views have no
defaults of their own (tests/config/test_settings_views.py), so a test names every value it depends on that
differs from the config's default."""

from flexmarl_benchmarks._views import (
    balancer_settings,
    cost_model,
    engine_config,
    lora_spec,
    loss_config,
    optimizer_config,
    router_settings,
    trainer_config,
)

__all__ = ["balancer_settings", "cost_model", "engine_config", "lora_spec", "loss_config", "optimizer_config",
           "router_settings", "trainer_config"]
