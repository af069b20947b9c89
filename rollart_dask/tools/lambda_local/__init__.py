"""A local Lambda-compatible endpoint (the AWS Lambda Invoke API on 127.0.0.1): the serverless reward
plane of the embedded default, and ``rollart rewards serve``. A tool around the runtime: the runtime
reaches any Lambda endpoint, this one or AWS, through boto3 (``rollart_dask.data.serverless``)."""
from rollart_dask.tools.lambda_local.server import LocalEndpoint, default_state_dir, serve, start_local_endpoint

__all__ = ["LocalEndpoint", "default_state_dir", "serve", "start_local_endpoint"]
