"""The host runtime that plays the engine's part: topology, batches, flags, layers, ledger."""
