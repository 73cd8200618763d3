"""The optimizer chain (docs/design.md §T2): head-wise Muon, AdamW and Sinkhorn-balanced momentum,
routed by one declarative table of parameter-path patterns; schedule and MoE bias update."""

from optim.chain import build_optimizer, init_opt_state, learning_rates, opt_state_shardings
from optim.config import OptimConfig, OptimConfigError, optim_config, optim_defaults
from optim.moe_bias import update_moe_bias
from optim.schedule import boundaries, learning_rate
from optim.table import TABLE, Row, TableError, label_params, label_tree, report

__all__ = [
    "build_optimizer", "init_opt_state", "learning_rates", "opt_state_shardings", "OptimConfig",
    "OptimConfigError", "optim_config", "optim_defaults", "update_moe_bias", "boundaries",
    "learning_rate", "TABLE", "Row", "TableError", "label_params", "label_tree", "report",
]
