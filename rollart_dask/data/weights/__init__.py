"""Weight transfer from the trainer to the engines: bucketed, checksummed versions published
after each Train and pulled by every engine while rollout goes on (store: dask or mooncake)."""
