"""Rewards: plain functions of a finished trajectory (a JSON-serialisable dict) returning a
float or a dict with ``score``. Nothing here imports the runtime."""
