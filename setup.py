"""Packages (the metadata is in setup.cfg). envs/ and rewards/ stay at the top of the repository, as the design
card puts them, but install as rollart_dask.envs and rollart_dask.rewards: a user's own `envs` cannot collide."""

from setuptools import find_packages, setup

MAPPED = ("envs", "rewards")

setup(
    packages=find_packages(include=["rollart_dask", "rollart_dask.*"])
    + [f"rollart_dask.{p}" for p in find_packages(include=[f"{t}{s}" for t in MAPPED for s in ("", ".*")])],
    package_dir={f"rollart_dask.{t}": t for t in MAPPED},
    package_data={"rollart_dask.envs": ["latency/*.csv"]},
)
