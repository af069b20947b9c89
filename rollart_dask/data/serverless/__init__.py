"""Rewards as AWS Lambda functions: packaging/deploy and a boto3 client (the reward plane's transport).

The same boto3 calls work against AWS Lambda and against the local endpoint
(``rollart_dask.serve.lambda_local``, started for a run on the embedded default):

    ep = start_local_endpoint()                       # from rollart_dask.serve.lambda_local
    client = make_lambda_client(ep.url)               # make_lambda_client() for AWS
    deploy("reward-math", "math", client)
    result, stats = invoke_reward(client, "reward-math", trajectory)

Names are imported lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "make_lambda_client": "client",
    "invoke_reward": "client",
    "ainvoke_reward": "client",
    "parse_report": "client",
    "InvokeStats": "client",
    "RewardError": "client",
    "RewardFunctionError": "client",
    "RewardUnavailable": "client",
    "TOKEN_ENV": "client",
    "build_zip": "package",
    "deploy": "package",
    "deploy_zip": "package",
    "delete": "package",
    "handler_for": "package",
    "reward_module": "package",
    "code_sha256": "package",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
