"""Special adapters (attention, CP, TBO, branch, LoRA); none are in this slice yet."""
