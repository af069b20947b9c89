"""`rollart rewards` and `rollart cluster`: the services a run uses, brought up or checked on their own (a local
Lambda-compatible endpoint and deploying a reward to it or to AWS; the local pools, TLS certificates, a cluster's pools)."""

from __future__ import annotations

import asyncio

import click

from rollart_dask.config import FlowError, load_flow


@click.group()
def rewards():
    """Rewards as AWS Lambda functions: a local endpoint, and deploy to it or to AWS."""


@rewards.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address (off loopback the token must be given)")
@click.option("--port", default=0, show_default=True, help="0: a free port (printed with the URL)")
@click.option(
    "--token",
    envvar="ROLLART_LAMBDA_TOKEN",
    default=None,
    help="shared secret: requests must be SigV4-signed with it as the secret key (default: a new one, printed)",
)
@click.option("--keep-warm-s", default=300.0, show_default=True, help="idle execution environments retire after this (scale to zero)")
@click.option("--default-concurrency", default=None, type=int, help="per-function limit without reserved concurrency (default 2 x CPUs)")
@click.option(
    "--state-dir", default=None, type=click.Path(file_okay=False), help="functions, code and logs (default ~/.cache/rollart-dask/lambda)"
)
def rewards_serve(host, port, token, keep_warm_s, default_concurrency, state_dir):
    """Run the local Lambda-compatible endpoint (Invoke, Create/Update/Get/DeleteFunction, concurrency)."""
    from rollart_dask.serve.lambda_local import serve

    try:
        serve(host=host, port=port, token=token, keep_warm_s=keep_warm_s, default_concurrency=default_concurrency, state_dir=state_dir)
    except ValueError as e:
        raise click.ClickException(str(e))


@rewards.command("deploy")
@click.argument("reward")
@click.option("--function", "function_name", default=None, help="Lambda function name (default rollart-reward-REWARD)")
@click.option("--endpoint-url", default=None, help="a local endpoint (http://127.0.0.1:9001); omit for AWS Lambda")
@click.option("--region", default="us-east-1", show_default=True)
@click.option("--role-arn", default=None, help="execution role (required by AWS)")
@click.option("--timeout", default=30, show_default=True, help="function timeout, seconds")
@click.option("--memory", default=512, show_default=True, help="MB")
@click.option("--concurrency", default=None, type=int, help="reserved concurrency (the function's limit)")
@click.option("--token", envvar="ROLLART_LAMBDA_TOKEN", default=None, help="the endpoint's token, when it has one")
def rewards_deploy(reward, function_name, endpoint_url, region, role_arn, timeout, memory, concurrency, token):
    """Package REWARD (a registered name like 'math', or a module) and create or update its function."""
    from rollart_dask.data.serverless import deploy, make_lambda_client

    name = function_name or f"rollart-reward-{reward.replace('.', '-').replace(':', '-').replace('_', '-')}"
    client = make_lambda_client(endpoint_url, region=region, token=token)
    try:
        out = deploy(name, reward, client, role_arn=role_arn, timeout=timeout, memory=memory, concurrency=concurrency)
    except (KeyError, ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e))
    click.echo(f"{out['action']} {out['function_arn']} (code sha256 {out['code_sha256']})")


@click.group()
def cluster():
    """The embedded local cluster; check a running one against a flow."""


@cluster.command("up")
@click.argument("flow", required=False, type=click.Path(dir_okay=False))
def cluster_up(flow):
    """Start the local heterogeneous pools (from FLOW's cluster section) and wait; Ctrl-C stops them."""
    from rollart_dask.config import ClusterConfig
    from rollart_dask.observe import console
    from rollart_dask.resource.cluster import connect
    from rollart_dask.resource.pools import PoolMap
    from rollart_dask.resource.security import describe

    cfg = load_flow(flow).cluster if flow else ClusterConfig()

    async def up():
        client, cl = await connect(cfg)
        info = await client.scheduler.identity()
        for line in describe(cfg, client.scheduler.address, client.dashboard_link):
            console.print(line)
        click.echo("workers: " + PoolMap.from_scheduler_info(info).describe())
        try:
            while True:
                await asyncio.sleep(3600)
        finally:
            await client.close()
            if cl:
                await cl.close()

    try:
        asyncio.run(up())
    except KeyboardInterrupt:
        pass


@cluster.command("certs")
@click.argument("directory", type=click.Path(file_okay=False))
def cluster_certs(directory):
    """Write a CA, certificate and key (ca.pem, cert.pem, key.pem) to DIRECTORY for a TLS cluster (deploy/ recipes,
    cluster.security); every node and the client use the same three files."""
    from rollart_dask.resource.security import write_certificates

    paths = write_certificates(directory)
    click.echo("\n".join(f"{k}: {v}" for k, v in paths.items()))
    click.echo("flow: cluster: {security: {" + ", ".join(f"{k}: {v}" for k, v in paths.items()) + "}}")


@cluster.command("check")
@click.argument("flow", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--scheduler",
    default=None,
    metavar="ADDR",
    help="the scheduler to check (default: FLOW's cluster.scheduler, else the embedded cluster)",
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a flow key, as for `rollart run`")
def cluster_check(flow, scheduler, overrides):
    """List the pools of a cluster with their workers and, given FLOW, whether it can run there (non-zero exit if not)."""
    from rich.console import Console

    from rollart_dask.resource.cluster import connect
    from pydantic import ValidationError

    from rollart_dask.resource.check import check_cluster, pools_table
    from rollart_dask.config import ClusterConfig

    at = [f"cluster.scheduler={scheduler}"] if scheduler else []
    try:
        cfg = load_flow(flow, [*overrides, *at]) if flow else None
        ccfg = cfg.cluster.model_copy() if cfg else ClusterConfig.model_validate({"scheduler": scheduler})
    except (FlowError, ValidationError) as e:
        raise click.ClickException(str(e))

    async def snapshot():
        client, cl = await connect(ccfg)
        try:
            return client.scheduler.address, await client.scheduler.identity()
        finally:
            await client.close()
            if cl:
                await cl.close()

    try:
        address, info = asyncio.run(snapshot())
    except OSError as e:  # unreachable scheduler: distributed raises OSError after its connect timeout
        raise click.ClickException(f"cannot reach scheduler {ccfg.scheduler}: {e}")
    except FlowError as e:  # e.g. a tls:// scheduler without certificates
        raise click.ClickException(str(e))
    rows, problems = check_cluster(info, cfg)
    title = f"{address}: {len(info['workers'])} workers" + (f" — flow {cfg.name}" if cfg else "")
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)  # a log or a pipe: one line per worker rather than 80-column wrapping
    out.print(pools_table(rows, title))
    if problems:
        raise click.ClickException(f"flow {cfg.name} cannot run on {address}: " + "; ".join(problems))
    if cfg:
        out.print(f"flow {cfg.name} can run on {address}")
