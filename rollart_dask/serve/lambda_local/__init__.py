"""A local Lambda-compatible endpoint (the AWS Lambda Invoke API on 127.0.0.1): the serverless reward
plane of the embedded default, and ``rollart rewards serve``. A tool around the runtime: the runtime
reaches any Lambda endpoint, this one or AWS, through boto3 (``rollart_dask.data.serverless``)."""

from __future__ import annotations

import importlib

__all__ = ["LocalEndpoint", "default_state_dir", "serve", "start_local_endpoint"]


def __getattr__(name):  # lazy: `python -m rollart_dask.serve.lambda_local.server` must not find server imported already
    if name in __all__:
        return getattr(importlib.import_module("rollart_dask.serve.lambda_local.server"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
