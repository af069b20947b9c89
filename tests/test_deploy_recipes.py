"""deploy/ recipes: Kubernetes manifests against the dask-kubernetes CRD schemas, shell scripts
parse, and every recipe tags its workers with the runtime's pools."""

import copy
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollart_dask.resource.pools import POOLS, TAG_CAPACITY

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
GROUP = "kubernetes.dask.org"


def parse_resources(value: str) -> dict[str, float]:
    return {k: float(v) for k, v in (item.split("=") for item in value.split())}


def assert_pool_tags(resources: dict[str, float], where: str) -> None:
    assert resources and set(resources) <= set(POOLS), f"{where}: {resources} (pools: {POOLS})"
    assert all(v == TAG_CAPACITY for v in resources.values()), f"{where}: pools are tags of capacity {TAG_CAPACITY}: {resources}"


# -- Kubernetes ---------------------------------------------------------------------------------


def closed(schema):
    """The API server prunes unknown fields of a custom resource unless the client asks for strict
    field validation, so a typo (``nodeselector``) could apply and do nothing: close every object
    that lists its properties, unless it preserves unknown fields."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_schemas():
    """kind → the v1 openAPIV3Schema of the CRDs shipped in dask_kubernetes (the fully resolved copies)."""
    dk = pytest.importorskip(
        "dask_kubernetes", reason="dask-kubernetes is not installed (pip install -e '.[dev]'): cannot validate deploy/kubernetes"
    )
    schemas = {}
    for path in sorted(Path(dk.__file__).parent.rglob("*.yaml")):
        text = path.read_text()
        if "kind: CustomResourceDefinition" not in text:  # also skips the Helm templates, which are not YAML
            continue
        for doc in yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # the CRDs are large: libyaml when present
            if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition" or doc["spec"]["group"] != GROUP:
                continue
            for version in doc["spec"]["versions"]:
                schema = version["schema"]["openAPIV3Schema"]
                if version["name"] == "v1" and "$ref" not in yaml.safe_dump(schema):  # unresolved templates: skip
                    schemas[doc["spec"]["names"]["kind"]] = closed(schema)
    assert {"DaskCluster", "DaskWorkerGroup"} <= set(schemas), f"CRDs not found in {dk.__file__}: {sorted(schemas)}"
    return schemas


def manifests():
    return [(p.name, doc) for p in sorted((DEPLOY / "kubernetes").glob("*.yaml")) for doc in yaml.safe_load_all(p.read_text()) if doc]


def dask_docs():
    return [(name, doc) for name, doc in manifests() if doc["apiVersion"].startswith(GROUP + "/")]


def validate(doc, schemas):
    import jsonschema

    assert doc["apiVersion"] == f"{GROUP}/v1"
    spec_schema = schemas[doc["kind"]]["properties"]["spec"]
    jsonschema.validate(doc["spec"], spec_schema, cls=jsonschema.Draft4Validator)  # OpenAPI v3 schemas are draft-4 style


def worker_specs(doc):
    """(group name, pod spec) of each worker group a manifest defines (a DaskCluster's is its default group)."""
    if doc["kind"] == "DaskCluster":
        return [(f"{doc['metadata']['name']}-default", doc["spec"]["worker"]["spec"])]
    if doc["kind"] == "DaskWorkerGroup":
        return [(doc["metadata"]["name"], doc["spec"]["worker"]["spec"])]
    return []


def test_kubernetes_manifests_match_the_crd_schemas(crd_schemas):
    import jsonschema

    docs = dask_docs()
    assert {d["kind"] for _, d in docs} == {"DaskCluster", "DaskWorkerGroup"}
    for name, doc in docs:
        try:
            validate(doc, crd_schemas)
        except jsonschema.ValidationError as e:
            raise AssertionError(f"deploy/kubernetes/{name}: {e}") from None


def test_the_schema_check_catches_a_typo(crd_schemas):
    import jsonschema

    _, doc = next((n, d) for n, d in dask_docs() if d["kind"] == "DaskWorkerGroup")
    bad = copy.deepcopy(doc)
    bad["spec"]["worker"]["spec"]["nodeselector"] = bad["spec"]["worker"]["spec"].pop("nodeSelector")
    with pytest.raises(jsonschema.ValidationError, match="nodeselector"):
        validate(bad, crd_schemas)
    bad = copy.deepcopy(doc)
    del bad["spec"]["cluster"]
    with pytest.raises(jsonschema.ValidationError, match="cluster"):
        validate(bad, crd_schemas)


def test_kubernetes_worker_groups_carry_the_pools():
    docs = dask_docs()
    clusters = {d["metadata"]["name"] for _, d in docs if d["kind"] == "DaskCluster"}
    groups = {}
    for name, doc in docs:
        if doc["kind"] == "DaskWorkerGroup":
            assert doc["spec"]["cluster"] in clusters, f"{name}: unknown cluster {doc['spec']['cluster']}"
        for group, pod in worker_specs(doc):
            (container,) = pod["containers"]
            cmd = container["command"]
            assert cmd[:2] == ["dask", "worker"], f"{name}: {cmd}"
            assert cmd[cmd.index("--name") + 1] == "$(DASK_WORKER_NAME)"  # the operator's name
            assert cmd[2] == "tls://rollart-scheduler:8786", f"{name}: {cmd}"  # TLS: the operator's env says tcp://
            assert_tls(cmd, container, pod, name)
            resources = parse_resources(cmd[cmd.index("--resources") + 1])
            assert_pool_tags(resources, name)
            gpu = bool({"H800", "H20"} & set(resources))
            if gpu:  # generation and training groups land on their GPU type and hold a GPU
                assert pod["nodeSelector"]["nvidia.com/gpu.product"] in ("NVIDIA-H800", "NVIDIA-H20"), name
                assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1, name
            if "H20" in resources:
                assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H20", name
            if "H800" in resources:
                assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H800", name
            groups[group] = resources
    assert set().union(*groups.values()) == set(POOLS), groups
    assert {"rollart-h800", "rollart-h20", "rollart-env-cpu", "rollart-train", "rollart-reward", "rollart-default"} <= set(groups)
    assert set(groups["rollart-train"]) == {"H800", "TRAIN"}  # the trainer's worker is also tagged H800
    assert set(groups["rollart-env-cpu"]) == {"CPU"}


TLS_DIR = "/etc/rollart/tls"


def assert_tls(cmd: list, container: dict, pod: dict, where: str) -> None:
    """The cluster's certificate, from the rollart-tls Secret, given to the process."""
    for flag, name in (("--tls-ca-file", "ca.pem"), ("--tls-cert", "cert.pem"), ("--tls-key", "key.pem")):
        assert cmd[cmd.index(flag) + 1] == f"{TLS_DIR}/{name}", f"{where}: {cmd}"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["tls"] == TLS_DIR and volumes["tls"]["secret"]["secretName"] == "rollart-tls", where


def test_the_kubernetes_scheduler_speaks_tls_and_the_secret_holds_the_three_files():
    (cluster,) = [d for _, d in dask_docs() if d["kind"] == "DaskCluster"]
    pod = cluster["spec"]["scheduler"]["spec"]
    (container,) = pod["containers"]
    cmd = container["command"]
    assert cmd[:2] == ["dask", "scheduler"] and cmd[cmd.index("--protocol") + 1] == "tls", cmd
    assert_tls(cmd, container, pod, "scheduler")
    (secret,) = [d for name, d in manifests() if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "rollart-tls" and set(secret["data"]) == {"ca.pem", "cert.pem", "key.pem"}


# -- shell recipes (Slurm, SSH, local) ------------------------------------------------------------


def shell_scripts():
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shell_scripts_parse(script):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def pools_sh(*lines: str) -> str:
    return subprocess.run(
        ["bash", "-c", "source deploy/pools.sh && " + " && ".join(lines)], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


def test_pools_sh_maps_every_pool():
    names = pools_sh("echo $ROLLART_POOLS").split()
    tags = {}
    for name in names:
        tags[name] = parse_resources(pools_sh(f"pool_resources {name}"))
        assert_pool_tags(tags[name], f"deploy/pools.sh {name}")
    assert set().union(*tags.values()) == set(POOLS)
    assert set(tags["train"]) == {"H800", "TRAIN"}
    res = subprocess.run(["bash", "-c", "source deploy/pools.sh && pool_resources h100"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode != 0 and "unknown pool 'h100'" in res.stderr


def recorder(tmp_path: Path, name: str, reply: str = "") -> Path:
    """A stand-in for ssh / sbatch that records its arguments, one shell-quoted line per call."""
    log = tmp_path / f"{name}.calls"
    tool = tmp_path / "bin" / name
    tool.parent.mkdir(exist_ok=True)
    tool.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {log}\necho >> {log}\n{reply}\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return log


def certs(tmp_path: Path) -> Path:
    from rollart_dask.resource.security import write_certificates

    write_certificates(tmp_path / "tls")
    return tmp_path / "tls"


def test_ssh_recipe_starts_one_scheduler_and_tagged_workers(tmp_path):
    log, copies = recorder(tmp_path, "ssh"), recorder(tmp_path, "scp")
    env = {
        **os.environ,
        "SSH": str(tmp_path / "bin" / "ssh"),
        "SCP": str(tmp_path / "bin" / "scp"),
        "SCHEDULER_WAIT_S": "0",
        "PORT": "8790",
        "TLS_DIR": str(certs(tmp_path)),
    }
    res = subprocess.run(["deploy/ssh/cluster.sh", "start", "deploy/ssh/hosts.example"], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "tls://gpu-h800-01:8790"
    assert f"--set cluster.security.key={tmp_path / 'tls'}/key.pem" in res.stderr  # how the client attaches
    hosts = {
        line.split()[0]
        for line in (REPO / "deploy/ssh/hosts.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    scp = [shlex.split(line) for line in copies.read_text().splitlines()]
    assert sorted(c[-1].split(":")[0] for c in scp) == sorted(hosts) and all(len(c) == 5 for c in scp), scp  # -q, 3 files, host:dir
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    tls = "--tls-ca-file /tmp/rollart-cluster/tls/ca.pem --tls-cert /tmp/rollart-cluster/tls/cert.pem --tls-key /tmp/rollart-cluster/tls/key.pem"
    # one scheduler, with the preload that lists the RollArt page in JupyterLab (rollart_dask/serve/dashboard/preload.py)
    assert (
        sum(f"dask scheduler --protocol tls --port 8790 --preload rollart_dask.serve.dashboard.preload {tls}" in cmd for _, cmd in calls)
        == 1
    )
    workers = [(host, shlex.split(cmd.split("dask worker", 1)[1].split(">", 1)[0]), cmd) for host, cmd in calls if "dask worker" in cmd]
    assert len(workers) == 1 + 7 + 8 + 8 + 2 + 1 + 1  # hosts.example: workers per line
    assert all(tls in cmd for _, _, cmd in workers)
    seen, gpus = set(), {}
    for host, args, cmd in workers:
        assert args[0] == "tls://gpu-h800-01:8790"
        resources = parse_resources(args[args.index("--resources") + 1])
        assert_pool_tags(resources, cmd)
        seen |= set(resources)
        if "CUDA_VISIBLE_DEVICES=" in cmd:
            gpus.setdefault(host, []).append(int(cmd.split("CUDA_VISIBLE_DEVICES=")[1].split()[0]))
        else:
            assert not set(resources) & {"H800", "H20"}, cmd
    assert seen == set(POOLS)
    assert all(sorted(g) == list(range(len(g))) for g in gpus.values()), gpus  # a host's GPU workers get distinct GPUs
    # an unknown pool is an error naming it, before anything starts on that line
    (tmp_path / "hosts").write_text("a scheduler\nb h100 1\n")
    res = subprocess.run(["deploy/ssh/cluster.sh", "start", str(tmp_path / "hosts")], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "unknown pool 'h100'" in res.stderr
    # plain TCP only when asked, and said so
    res = subprocess.run(
        ["deploy/ssh/cluster.sh", "start", "deploy/ssh/hosts.example"],
        cwd=REPO,
        env={**env, "ROLLART_TLS": "off"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and res.stdout.strip() == "tcp://gpu-h800-01:8790" and "plain TCP" in res.stderr, res.stderr


def test_slurm_recipe_submits_the_scheduler_then_one_job_per_pool(tmp_path):
    log = recorder(tmp_path, "sbatch", reply="echo 4242")
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "ROLLART_SHARED": str(tmp_path / "shared"),
        "ROLLART_CLI": f"{sys.executable} -m rollart_dask.entry.cli",
    }
    res = subprocess.run(["deploy/slurm/submit.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    tls = tmp_path / "shared" / "tls"  # made for the cluster on the shared directory, the key its owner's alone
    assert all((tls / f).stat().st_size > 0 for f in ("ca.pem", "cert.pem", "key.pem")) and (tls / "key.pem").stat().st_mode & 0o077 == 0
    assert f"--set cluster.security.ca_file={tls}/ca.pem" in res.stderr
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    assert calls[0][-1].endswith("scheduler.sbatch")
    pools = pools_sh("echo $ROLLART_POOLS").split()
    assert len(calls) == 1 + len(pools)
    seen = set()
    for call, pool in zip(calls[1:], pools):
        i = next(i for i, a in enumerate(call) if a.endswith("worker.sbatch"))
        assert "--dependency=after:4242" in call[:i]  # workers start once the scheduler runs
        assert call[i + 1] == pool
        resources = parse_resources(call[i + 2])
        assert_pool_tags(resources, " ".join(call))
        seen |= set(resources)
        assert any(a.startswith("--gpus-per-task=") for a in call[:i]) == bool(set(resources) & {"H800", "H20"})
    assert seen == set(POOLS)


def test_slurm_jobs_start_the_scheduler_and_workers_with_the_clusters_certificate(tmp_path):
    """scheduler.sbatch and worker.sbatch as Slurm runs them (copies, found pools.sh through ROLLART_DEPLOY)."""
    dask, srun = (
        recorder(tmp_path, "dask", reply='echo \'{"address": "tls://n1:8786"}\' > "$ROLLART_SHARED/scheduler.json"'),
        recorder(tmp_path, "srun"),
    )
    shared, tls = tmp_path / "shared", certs(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "ROLLART_SHARED": str(shared),
        "ROLLART_DEPLOY": str(DEPLOY),
        "ROLLART_TLS_DIR": str(tls),
    }
    res = subprocess.run(["bash", "deploy/slurm/scheduler.sbatch"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    (scheduler,) = [shlex.split(line) for line in dask.read_text().splitlines()]
    assert scheduler[0] == "scheduler" and scheduler[scheduler.index("--protocol") + 1] == "tls", scheduler
    assert scheduler[scheduler.index("--tls-key") + 1] == f"{tls}/key.pem"
    shared.joinpath("scheduler-address").write_text("tls://n1:8786\n")  # (scheduler.sbatch removes it as it exits)
    res = subprocess.run(
        ["bash", "deploy/slurm/worker.sbatch", "h20", "H20=1000000", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    (worker,) = [shlex.split(line) for line in srun.read_text().splitlines()]
    assert worker[3] == "tls://n1:8786" and worker[-1] == f"--tls-ca-file {tls}/ca.pem --tls-cert {tls}/cert.pem --tls-key {tls}/key.pem", (
        worker
    )
