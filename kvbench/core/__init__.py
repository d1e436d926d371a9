"""The contract every layer shares: schedules, plans, selections, the per-step context, errors, checks."""
