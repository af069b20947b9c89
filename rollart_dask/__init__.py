"""rollart-dask: RollArt-style agentic RL (disaggregated, trajectory-level asynchronous) on Dask distributed."""
__version__ = "0.1.0"

from rollart_dask.entry.launch import RunHandle, launch  # noqa: E402  (the notebook API)

__all__ = ["launch", "RunHandle", "__version__"]
