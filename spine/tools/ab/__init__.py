"""A/B comparison: one workload through several layouts, side by side (`spine ab`)."""
