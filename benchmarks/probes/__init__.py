"""Diagnostics: where a workload's time goes (no anchor, no results JSON)."""
