"""Algorithms: advantage estimators and losses as small registered functions. No Dask."""
