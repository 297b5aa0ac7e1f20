"""Which features combine: the one table of combination rules that every caller asks.

The table lives in ``layer_boundary/runtime/capabilities.py``, beside ``BoundaryRuntime``,
which asks it when built (the runtime imports nothing above itself). This module keeps the
public names at the place the command line, the engine, models and adapters import them from.
"""

from __future__ import annotations

from .runtime.capabilities import (GRAPH_RULES, LAYOUT_RULES, MODEL_RULES, PAIRS,
                                   CapabilityError, Feature, GraphRule, PairRule, Rule, Setup,
                                   check, check_invariant, check_model, check_runtime,
                                   graph_blocker, mode_features, pair_rule, refusals,
                                   runtime_features)

__all__ = ["CapabilityError", "Feature", "GRAPH_RULES", "GraphRule", "LAYOUT_RULES",
           "MODEL_RULES", "PAIRS", "PairRule", "Rule", "Setup", "check", "check_invariant",
           "check_model", "check_runtime", "graph_blocker", "mode_features", "pair_rule",
           "refusals", "runtime_features"]
