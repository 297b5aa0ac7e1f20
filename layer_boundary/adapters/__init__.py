"""Adapters for handoffs a sequential prepare call cannot express (spec, "Special adapters")."""

from .branch import branch_input, branch_output, merge_branch

__all__ = ["branch_input", "branch_output", "merge_branch"]
