"""Scaling the prefill and decode pools on their own signals: the pure planner, the signals it
reads, the loop that applies its decisions, and the replica counts it owns."""
