"""rollart-dask: RollArt-style agentic RL (disaggregated, trajectory-level asynchronous) on Dask distributed."""
__version__ = "0.1.0"
