"""Agents: profiles that say what `corral run --agent NAME` runs, and how it is installed."""
