"""What a run starts or serves beside itself: the local Lambda-compatible reward endpoint (``lambda_local``) and the
RollArt page on the scheduler's dashboard with its Prometheus series (``dashboard``). Offline tools a user runs
(ablations, reports, the chaos suite) are in ``rollart_dask.tools``."""
