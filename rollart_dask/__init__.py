"""rollart-dask: RollArt-style agentic RL (disaggregated, trajectory-level asynchronous) on Dask distributed.

``import rollart_dask`` is light (the declarative decorators, rollart_dask/declare.py): a decorated
reward's Lambda function imports it too. The notebook API (``launch``, ``RunHandle``) loads on first use.
"""

__version__ = "0.1.0"

from rollart_dask.declare import env, reward  # noqa: E402  (the declarative API)

__all__ = ["env", "reward", "launch", "RunHandle", "__version__"]


def __getattr__(name):
    if name in ("launch", "RunHandle"):
        from rollart_dask.entry import launch as notebook

        return getattr(notebook, name)
    raise AttributeError(f"module 'rollart_dask' has no attribute {name!r}")
