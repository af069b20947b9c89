"""Data plane: services that live inside Dask workers (engine, env host, reward runner, trainer).

Each is held by a WorkerPlugin (re-installed when a worker restarts) and reached from thin
task functions in ``tasks.py``.
"""
