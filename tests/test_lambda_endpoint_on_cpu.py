"""The local Lambda endpoint against real boto3 calls: management, invoke semantics, pools, limits, auth."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError

from rollart_dask.data.serverless import (
    RewardFunctionError,
    RewardUnavailable,
    build_zip,
    code_sha256,
    deploy,
    deploy_zip,
    invoke_reward,
    make_lambda_client,
    parse_report,
)
from rollart_dask.serve.lambda_local import start_local_endpoint

CUSTOM = """
import os, time
VERSION = {version}

def handler(event, context):
    if event.get("raise"):
        raise ValueError("bad trajectory: " + event["raise"])
    if event.get("exit"):
        os._exit(3)
    if event.get("sleep"):
        time.sleep(event["sleep"])
    if event.get("print"):
        print(event["print"])
    if event.get("nonreward"):
        return {{"value": 1}}
    return {{"score": float(VERSION), "success": True, "pid": os.getpid(), "remaining_ms": context.get_remaining_time_in_millis()}}
"""


def custom_zip(tmp_path, version: int) -> bytes:
    d = tmp_path / f"v{version}"
    d.mkdir(exist_ok=True)
    (d / "custom_reward.py").write_text(CUSTOM.format(version=version))
    return build_zip("custom_reward", root=d, include=["custom_reward.py"])


def stats_of(ep, name):
    return ep.stats()["functions"][name]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with start_local_endpoint(state_dir=tmp_path_factory.mktemp("lambda"), keep_warm_s=30, default_concurrency=4) as ep:
        yield ep


@pytest.fixture(scope="module")
def client(endpoint):
    return make_lambda_client(endpoint.url, timeout_s=30, token=endpoint.token)


@pytest.fixture
def custom(client, tmp_path, request):
    """A fresh function running the custom handler (version 1), deleted afterwards."""
    name = "custom-" + request.node.name.replace("_", "-")[:40]
    deploy_zip(client, name, custom_zip(tmp_path, 1), "custom_reward.handler", timeout=5)
    yield name
    client.delete_function(FunctionName=name)


def test_management_create_get_update_delete(client, tmp_path):
    out = deploy("fl-mgmt", "frozenlake", client, timeout=7, memory=256)
    assert out["action"] == "created"
    got = client.get_function(FunctionName="fl-mgmt")
    cfg = got["Configuration"]
    assert cfg["Handler"] == "rollart_dask.rewards.frozenlake.handler" and cfg["Timeout"] == 7 and cfg["MemorySize"] == 256
    assert cfg["State"] == "Active" and cfg["Version"] == "$LATEST" and cfg["CodeSha256"] == out["code_sha256"]
    assert cfg["CodeSize"] > 0 and cfg["FunctionArn"].endswith(":function:fl-mgmt")
    assert deploy("fl-mgmt", "frozenlake", client, timeout=7, memory=256)["action"] == "unchanged"  # reproducible zip
    assert deploy("fl-mgmt", "frozenlake", client, timeout=9, memory=256)["configuration"]["Timeout"] == 9
    with pytest.raises(client.exceptions.ResourceConflictException):
        client.create_function(
            FunctionName="fl-mgmt",
            Runtime="python3.12",
            Role="arn:aws:iam::000000000000:role/x",
            Handler="rollart_dask.rewards.frozenlake.handler",
            Code={"ZipFile": build_zip("frozenlake")},
        )
    client.put_function_concurrency(FunctionName="fl-mgmt", ReservedConcurrentExecutions=3)
    assert client.get_function(FunctionName="fl-mgmt")["Concurrency"]["ReservedConcurrentExecutions"] == 3
    assert "fl-mgmt" in [f["FunctionName"] for f in client.list_functions()["Functions"]]
    client.delete_function(FunctionName="fl-mgmt")
    with pytest.raises(client.exceptions.ResourceNotFoundException):
        client.get_function(FunctionName="fl-mgmt")


def test_update_code_changes_behaviour(client, custom, tmp_path):
    assert invoke_reward(client, custom, {"task": "x"})[0]["score"] == 1.0
    out = deploy_zip(client, custom, custom_zip(tmp_path, 2), "custom_reward.handler", timeout=5)
    assert out["action"] == "updated" and out["configuration"]["CodeSha256"] == code_sha256(custom_zip(tmp_path, 2))
    result, stats = invoke_reward(client, custom, {"task": "x"})
    assert result["score"] == 2.0 and stats.cold_start  # the old code's environment was retired


def test_invoke_matches_direct_reward_frozenlake_and_math(client):
    from rollart_dask.envs.reasoning import MathEnv
    from rollart_dask.rewards import frozenlake, reasoning

    deploy("fl", "frozenlake", client)
    for traj in (
        {"task": "frozenlake", "info": {"success": True, "malformed": 0}, "turns": []},
        {"task": "frozenlake", "info": {"success": False, "malformed": 2}, "turns": []},
    ):
        assert invoke_reward(client, "fl", traj)[0] == frozenlake.reward(traj)
    # By ARN and with the $LATEST qualifier too; another qualifier does not exist.
    arn = client.get_function(FunctionName="fl")["Configuration"]["FunctionArn"]
    assert invoke_reward(client, arn, traj, qualifier="$LATEST")[0] == frozenlake.reward(traj)
    with pytest.raises(client.exceptions.ResourceNotFoundException):
        client.invoke(FunctionName="fl", Qualifier="7", Payload=b"{}")

    deploy("math", "math", client, timeout=60)
    env = MathEnv()
    for seed, good in ((3, True), (4, False)):
        q, _ = env.reset(seed)
        a = f"\\boxed{{{env.entry['answer']}}}" if good else "I do not know"
        _, r, _, _, info = env.step(a)
        traj = {"task": "math", "seed": seed, "turns": [{"observation": q, "action": a, "env_reward": r}], "info": info}
        remote, stats = invoke_reward(client, "math", traj)
        assert remote == reasoning.reward(traj) and remote["success"] is good
        assert stats.billed_ms >= 1


def test_cold_start_then_warm_reuse(client, custom):
    first, s1 = invoke_reward(client, custom, {}, log_tail=True)
    second, s2 = invoke_reward(client, custom, {"print": "hello from the handler"}, log_tail=True)
    assert s1.cold_start is True and s1.init_ms > 0 and s1.billed_ms >= 1
    assert s2.cold_start is False and s2.init_ms is None and first["pid"] == second["pid"]
    assert 0 < second["remaining_ms"] <= 5000
    # The log tail (as on AWS) carries the handler's output and the REPORT line.
    resp = client.invoke(FunctionName=custom, Payload=json.dumps({"print": "tail me"}), LogType="Tail")
    import base64

    log = base64.b64decode(resp["LogResult"]).decode()
    assert "tail me" in log and "REPORT RequestId:" in log
    report = parse_report(resp["LogResult"])
    assert report["billed_ms"] >= 1 and "init_ms" not in report


def test_scale_to_zero_after_keep_warm(tmp_path):
    with start_local_endpoint(state_dir=tmp_path / "state", keep_warm_s=0.5) as ep:
        c = make_lambda_client(ep.url, token=ep.token)
        deploy_zip(c, "z", custom_zip(tmp_path, 1), "custom_reward.handler")
        r1, s1 = invoke_reward(c, "z", {})
        st = stats_of(ep, "z")
        assert s1.cold_start and st["environments"] == 1 and st["pids"] == [r1["pid"]]
        deadline = time.time() + 10
        while time.time() < deadline and (stats_of(ep, "z")["environments"] or _alive(r1["pid"])):
            time.sleep(0.1)
        assert stats_of(ep, "z")["environments"] == 0 and not _alive(r1["pid"])
        r2, s2 = invoke_reward(c, "z", {})
        assert s2.cold_start and r2["pid"] != r1["pid"] and stats_of(ep, "z")["cold_starts"] == 2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its reaper is gone already
        return f.read().split(")")[-1].split()[0] != "Z"


def test_throttling_429_and_backoff(client, custom, endpoint):
    client.put_function_concurrency(FunctionName=custom, ReservedConcurrentExecutions=1)
    slow = json.dumps({"sleep": 0.6})

    def raw():
        try:
            return client.invoke(FunctionName=custom, Payload=slow)["StatusCode"]
        except client.exceptions.TooManyRequestsException as e:
            assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 429
            return 429

    with ThreadPoolExecutor(3) as pool:
        codes = sorted(pool.map(lambda _: raw(), range(3)))
    assert codes[0] == 200 and 429 in codes

    with ThreadPoolExecutor(3) as pool:
        results = list(
            pool.map(lambda _: invoke_reward(client, custom, {"sleep": 0.2}, retries=30, backoff=0.05, max_backoff=0.3), range(3))
        )
    assert all(r["score"] == 1.0 for r, _ in results)
    assert sum(s.throttles for _, s in results) > 0 and all(s.attempts == s.retries + 1 for _, s in results)
    st = stats_of(endpoint, custom)
    assert st["throttles"] > 0 and st["peak_busy"] == 1


def test_throttled_out_raises_unavailable(client, custom):
    client.put_function_concurrency(FunctionName=custom, ReservedConcurrentExecutions=0)
    with pytest.raises(RewardUnavailable, match=custom) as e:
        invoke_reward(client, custom, {}, retries=2, backoff=0.01)
    assert "TooManyRequestsException" in e.value.last_error and e.value.stats.throttles == 3


def test_handler_errors_propagate(client, custom):
    with pytest.raises(RewardFunctionError) as e:
        invoke_reward(client, custom, {"raise": "no info"})
    assert e.value.error_type == "ValueError" and "bad trajectory: no info" in e.value.error_message
    assert e.value.stack_trace and e.value.stats.attempts == 1  # not retried, no score made up
    resp = client.invoke(FunctionName=custom, Payload=json.dumps({"raise": "x"}))
    assert resp["StatusCode"] == 200 and resp["FunctionError"] == "Unhandled"
    body = json.loads(resp["Payload"].read())
    assert set(body) >= {"errorMessage", "errorType", "stackTrace"}
    with pytest.raises(RewardFunctionError, match="InvalidResult"):
        invoke_reward(client, custom, {"nonreward": True})
    with pytest.raises(RewardFunctionError) as e:
        invoke_reward(client, custom, {"exit": True})
    assert e.value.error_type == "Runtime.ExitError"
    assert invoke_reward(client, custom, {})[0]["score"] == 1.0  # a fresh environment serves on


def test_import_error_is_a_function_error(client, tmp_path):
    deploy_zip(client, "broken", custom_zip(tmp_path, 1), "no_such_module.handler")
    with pytest.raises(RewardFunctionError) as e:
        invoke_reward(client, "broken", {})
    assert e.value.error_type == "Runtime.ImportModuleError"
    client.delete_function(FunctionName="broken")


def test_timeout_kills_environment_and_endpoint_serves_on(client, tmp_path, endpoint):
    deploy_zip(client, "slowpoke", custom_zip(tmp_path, 1), "custom_reward.handler", timeout=1)
    pid = invoke_reward(client, "slowpoke", {})[0]["pid"]
    t0 = time.monotonic()
    with pytest.raises(RewardFunctionError) as e:
        invoke_reward(client, "slowpoke", {"sleep": 30})
    assert e.value.error_type == "Sandbox.Timedout" and "timed out after 1.00 seconds" in e.value.error_message
    assert time.monotonic() - t0 < 5
    result, stats = invoke_reward(client, "slowpoke", {})
    assert result["score"] == 1.0 and stats.cold_start and result["pid"] != pid
    st = stats_of(endpoint, "slowpoke")
    assert st["timeouts"] == 1 and st["errors"] == 1 and st["invocations"] == 3
    client.delete_function(FunctionName="slowpoke")


def test_event_and_dryrun_invocations(client, custom, endpoint):
    resp = client.invoke(FunctionName=custom, InvocationType="Event", Payload=json.dumps({"sleep": 0.05}))
    assert resp["StatusCode"] == 202
    assert client.invoke(FunctionName=custom, InvocationType="DryRun")["StatusCode"] == 204
    deadline = time.time() + 10
    while time.time() < deadline and stats_of(endpoint, custom)["invocations"] < 1:
        time.sleep(0.05)
    st = stats_of(endpoint, custom)
    assert st["async_invocations"] == 1 and st["invocations"] == 1


def test_unknown_function_404(client):
    with pytest.raises(client.exceptions.ResourceNotFoundException) as e:
        client.invoke(FunctionName="does-not-exist", Payload=b"{}")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    with pytest.raises(RewardUnavailable, match="does-not-exist") as e:
        invoke_reward(client, "does-not-exist", {})
    assert e.value.stats.attempts == 1


def test_oversize_payload_413(client, custom):
    big = {"blob": "x" * (6 * 1024 * 1024 + 10)}
    with pytest.raises(ClientError) as e:
        client.invoke(FunctionName=custom, Payload=json.dumps(big))
    err = e.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 413 and err["Error"]["Code"] == "RequestEntityTooLargeException"
    with pytest.raises(RewardUnavailable, match="413"):
        invoke_reward(client, custom, big)
    assert invoke_reward(client, custom, {})[0]["score"] == 1.0


def test_health_reports_tcp_nodelay(endpoint):
    import urllib.request

    with urllib.request.urlopen(endpoint.url + "/_local/health", timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "ok" and body["tcp_nodelay"] is True


def _non_loopback_ip() -> str:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outward interface
        ip = s.getsockname()[0]
    except OSError:
        ip = "0.0.0.0"
    finally:
        s.close()
    return ip if not ip.startswith("127.") else "0.0.0.0"


def test_non_loopback_bind_requires_token(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLART_LAMBDA_TOKEN", raising=False)
    with pytest.raises(ValueError, match="without an auth token"):
        start_local_endpoint(host="0.0.0.0", state_dir=tmp_path / "a")
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollart_dask.serve.lambda_local.server",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--state-dir",
            str(tmp_path / "b"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "ROLLART_LAMBDA_TOKEN"},
    )
    assert cli.returncode != 0 and "without an auth token" in cli.stderr

    token = "s3cret-token-for-tests-0123456789"
    host = _non_loopback_ip()
    with start_local_endpoint(host=host, token=token, state_dir=tmp_path / "c", mode="process") as ep:
        if host != "0.0.0.0":
            assert host in ep.url
        good = make_lambda_client(ep.url, token=token)
        deploy("fl", "frozenlake", good)
        traj = {"task": "frozenlake", "info": {"success": True, "malformed": 0}, "turns": []}
        assert invoke_reward(good, "fl", traj)[0]["score"] == 1.0
        for bad in (make_lambda_client(ep.url), make_lambda_client(ep.url, token="wrong-token-0123456789")):
            with pytest.raises(ClientError) as e:
                bad.invoke(FunctionName="fl", Payload=json.dumps(traj))
            assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] in (401, 403)
            with pytest.raises(RewardUnavailable):
                invoke_reward(bad, "fl", traj)
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(ep.url + "/_local/stats", timeout=5)
        assert e.value.code in (401, 403)
        stats = ep.stats()  # the handle sends the bearer token
        assert stats["functions"]["fl"]["invocations"] == 1 and stats["auth_failures"] >= 4


def test_step_figures_go_on_while_the_endpoint_restarts(tmp_path):
    """A step that ends while the run's endpoint is down (killed, not yet restarted) records that instead of failing the
    run; after the restart, whose counters start again from zero, the utilisation is a fraction again."""
    from rollart_dask.config import load_flow
    from rollart_dask.control.reward_plane import RewardPlane
    from tests.conftest import flow_dict

    plane = RewardPlane(load_flow(data=flow_dict(**{"reward.mode": "serverless"})), tmp_path)
    with start_local_endpoint(state_dir=tmp_path / "state", mode="process") as ep:
        plane.endpoint = ep
        client = make_lambda_client(ep.url, token=ep.token)
        deploy("fl", "frozenlake", client)
        traj = {"task": "frozenlake", "info": {"success": True, "malformed": 0}, "turns": []}
        for _ in range(3):
            invoke_reward(client, "fl", traj)
        before = plane.step_stats([], wall_s=1.0, n_reserved=1)
        assert 0 < before["utilisation"] <= 1 and "endpoint_unreachable" not in before
        ep.process.kill()
        down = plane.step_stats([], wall_s=1.0, n_reserved=1)
        assert "Connection refused" in down["endpoint_unreachable"] and "utilisation" not in down
        ep.process.restart()
        invoke_reward(client, "fl", traj)
        after = plane.step_stats([], wall_s=1.0, n_reserved=1)
        assert 0 < after["utilisation"] <= 1 and 0 <= after["paid_utilisation"] <= 1, after


def test_cli_deploy_then_invoke_through_boto3(endpoint, client):
    """`rollart rewards deploy` packages a registered reward and creates (then updates) it on the endpoint."""
    from click.testing import CliRunner

    from rollart_dask.entry.cli import main
    from rollart_dask.rewards.frozenlake import reward

    runner = CliRunner()
    first = runner.invoke(main, ["rewards", "deploy", "frozenlake", "--endpoint-url", endpoint.url, "--token", endpoint.token])
    assert first.exit_code == 0, first.output
    assert first.output.startswith("created ") and "rollart-reward-frozenlake" in first.output
    again = runner.invoke(main, ["rewards", "deploy", "frozenlake", "--endpoint-url", endpoint.url, "--token", endpoint.token])
    assert again.exit_code == 0 and again.output.split()[0] in ("unchanged", "updated")
    traj = {"task": "frozenlake", "seed": 1, "turns": [], "info": {"success": True, "malformed": 1}}
    result, _ = invoke_reward(client, "rollart-reward-frozenlake", traj)
    assert result == reward(traj)
    bad = runner.invoke(main, ["rewards", "deploy", "no_such_reward", "--endpoint-url", endpoint.url, "--token", endpoint.token])
    assert bad.exit_code != 0 and "no_such_reward" in bad.output
    judge = runner.invoke(main, ["rewards", "deploy", "judge", "--endpoint-url", endpoint.url])  # stateful: needs an engine
    assert judge.exit_code != 0 and "stateful" in judge.output and "REWARD pool" in judge.output


def test_relative_state_dir_serves_get_function(tmp_path, monkeypatch):
    """A run's output dir is often relative (runs/x/lambda): GetFunction must still answer."""
    monkeypatch.chdir(tmp_path)
    with start_local_endpoint(state_dir="rel/lambda", keep_warm_s=5) as ep:
        client = make_lambda_client(ep.url, timeout_s=30, token=ep.token)
        deploy("fl", "frozenlake", client)
        got = client.get_function(FunctionName="fl")
        assert got["Configuration"]["FunctionName"] == "fl" and got["Code"]["Location"].startswith("file:///")


def test_emulated_endpoint_faults_answer_429_500_or_late_at_their_rates():
    from rollart_dask.serve.lambda_local.api import LambdaError
    from rollart_dask.serve.lambda_local.faults import EndpointFaults

    faults = EndpointFaults({"throttle": 0.2, "error": 0.1, "slow": 0.1, "slow_s": 0.001, "seed": 5})
    codes = []

    async def go():
        for _ in range(2000):
            try:
                await faults.before_invoke()
                codes.append(200)
            except LambdaError as e:
                codes.append(e.status)

    asyncio.run(go())
    assert abs(codes.count(429) / 2000 - 0.2) < 0.03 and abs(codes.count(500) / 2000 - 0.1) < 0.03
    assert faults.injected["throttle"] == codes.count(429) and abs(faults.injected["slow"] / 2000 - 0.1) < 0.03
    assert not EndpointFaults().active and faults.active


def test_a_loopback_endpoint_asks_for_its_token_and_refuses_what_a_web_page_could_send(endpoint, client):
    """No request without the token, loopback too (a page the user visits can POST to 127.0.0.1); a Host that is not a
    loopback name (DNS rebinding) and a body a browser sends without a CORS preflight are refused before auth."""
    import urllib.error
    import urllib.request

    assert endpoint.token and len(endpoint.token) >= 16  # made for it: none was given
    with pytest.raises(ClientError) as e:
        make_lambda_client(endpoint.url, timeout_s=30).get_function(FunctionName="anything")  # (unsigned: dummy credentials)
    assert e.value.response["Error"]["Code"] == "InvalidSignatureException"

    def post(headers: dict) -> tuple[int, str]:
        req = urllib.request.Request(endpoint.url + "/2015-03-31/functions/f/invocations", data=b'{"a": 1}', headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    assert post({"Content-Type": "text/plain"})[0] == 415  # a form or text/plain: what needs no CORS preflight
    status, body = post({"Host": "attacker.example:80", "Content-Type": "application/json"})
    assert status == 403 and "is not a loopback name" in body
    status, body = post({"Content-Type": "application/json"})
    assert status == 403 and "missing or malformed AWS4-HMAC-SHA256 Authorization header" in body
    with pytest.raises(ClientError) as e:  # signed with the token: past auth, to the operation itself
        client.get_function(FunctionName="no-such-function")
    assert e.value.response["Error"]["Code"] == "ResourceNotFoundException"
