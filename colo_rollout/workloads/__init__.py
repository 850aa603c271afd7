"""What the engine is driven with: traces (generated, JSONL, Mooncake) and their replay, and the demo workload."""
