"""Deployment zips for reward functions and create-or-update deploys through the Lambda API.

The zip holds this project's ``rollart_dask.rewards`` and ``rollart_dask.envs`` packages (the repository's
``rewards/`` and ``envs/``; a reward may import helpers from envs) and the declarative API, without caches or
large data files; the handler is ``<module>.handler``. A reward
from a user's own module (``@rollart_dask.reward``, or any 'module:attr') adds that module (its file,
or its top-level package) and the few dependency-free files of rollart_dask its decorator needs; when
the module has no ``handler`` of its own, the function's handler is ``rollart_dask.declare.handler``,
told which function to call by its environment. Third-party
imports (reasoning_gym for the math reward) are not bundled: on AWS add them with
``extra_dirs`` (a ``pip install --target`` directory) or a layer. The zip is byte-for-byte
reproducible, so an unchanged reward deploys as a no-op (same CodeSha256).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import zipfile
from pathlib import Path

from rollart_dask.data.serverless.client import is_aws_endpoint

DEFAULT_PACKAGES = ("rollart_dask.rewards", "rollart_dask.envs")
EXCLUDE_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".git"}
EXCLUDE_SUFFIXES = (".pyc", ".pyo", ".so.tmp")
MAX_FILE_BYTES = 1 << 20  # larger files are data, not reward code
LOCAL_ROLE = "arn:aws:iam::000000000000:role/rollart-reward"
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def reward_module(reward: str) -> str:
    """'math' (a registry name) → 'rollart_dask.rewards.reasoning'; 'rollart_dask.rewards.reasoning:reward' →
    'rollart_dask.rewards.reasoning'; anything else is a module name as it is."""
    if ":" in reward:
        return reward.split(":", 1)[0]
    if "." in reward:
        return reward
    from rollart_dask.registry import REWARDS

    target = REWARDS.entries().get(reward)
    return target.split(":", 1)[0] if target else reward


def handler_for(reward: str) -> str:
    return f"{reward_module(reward)}.handler"


# importing rollart_dask.rewards runs rollart_dask/__init__.py, which loads the declarative API: these files, no more
DECLARE_FILES = ("rollart_dask/__init__.py", "rollart_dask/declare.py", "rollart_dask/registry.py")
HERE = Path(__file__).resolve().parents[3]  # the folder holding the rollart_dask package


def reward_target(reward: str) -> str:
    """The 'module:attr' a reward name stands for."""
    from rollart_dask.registry import reward_names

    return reward if ":" in reward else reward_names().get(reward, f"{reward}:reward")


def user_code(module: str) -> list[tuple[Path, str]]:
    """(source, zip path) pairs a zip needs for a reward module outside this project's packages: its file or
    top-level package; [] for the project's own rewards."""
    if module.startswith(tuple(f"{p}." for p in DEFAULT_PACKAGES)):
        return []
    top = module.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None and not spec.submodule_search_locations:
        raise FileNotFoundError(f"reward module {module!r} is not importable here, so it cannot be packaged")
    if spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))).resolve()
        return [(folder, folder.name)]
    return [(Path(spec.origin).resolve(), Path(spec.origin).name)]


def package_sources(packages=DEFAULT_PACKAGES) -> list[tuple[Path, str]]:
    """(folder, zip path) of each package as installed, and the declarative API's files: in a checkout
    rollart_dask.rewards is the repository's rewards/ folder, zipped as rollart_dask/rewards/."""
    out = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"the {name!r} package is not importable: pass root= and include=")
        out.append((Path(next(iter(spec.submodule_search_locations))).resolve(), name.replace(".", "/")))
    return out + [(HERE / f, f) for f in DECLARE_FILES]


def _files(source: Path, arc: str, max_file_bytes: int):
    if source.is_file():
        yield source, arc
        return
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is neither a package directory nor a module file")
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if path.is_dir() or any(p in EXCLUDE_DIRS for p in rel.parts) or path.name.endswith(EXCLUDE_SUFFIXES):
            continue
        if path.is_symlink() or path.stat().st_size > max_file_bytes:
            continue
        yield path, f"{arc}/{rel.as_posix()}"


def _holds(entries: dict, module: str) -> bool:
    base = module.replace(".", "/")
    return f"{base}.py" in entries or f"{base}/__init__.py" in entries


def build_zip(reward: str, root: str | Path | None = None, include=None, extra_dirs=(), max_file_bytes: int = MAX_FILE_BYTES) -> bytes:
    """A deployment zip (bytes) for ``reward``: this project's rewards and envs with the declarative API (or, given
    ``root``, the ``include`` packages/modules under it), a user module's code (``user_code``) plus the contents of
    each ``extra_dirs`` entry at the zip root. Checks that the reward module is inside."""
    module = reward_module(reward)
    if root is None:
        sources = package_sources(include or DEFAULT_PACKAGES)
    else:
        sources = [(Path(root) / e, e) for e in include or ()]
    entries: dict[str, Path] = {}
    for source, arc in sources:
        for path, name in _files(source, arc, max_file_bytes):
            entries[name] = path
    if not _holds(entries, module):  # a user's module, outside the included packages
        for source, arc in [*user_code(module), *((HERE / f, f) for f in DECLARE_FILES)]:
            for path, name in _files(source, arc, max_file_bytes):
                entries[name] = path
    for extra in extra_dirs:
        extra = Path(extra)
        for path in sorted(extra.rglob("*")):
            rel = path.relative_to(extra)
            if path.is_file() and not any(p in EXCLUDE_DIRS for p in rel.parts) and not path.name.endswith(EXCLUDE_SUFFIXES):
                entries.setdefault(rel.as_posix(), path)
    if not _holds(entries, module):
        raise FileNotFoundError(f"module {module!r} is not in the package (included: {[a for _, a in sources]})")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for arc in sorted(entries):
            info = zipfile.ZipInfo(arc, ZIP_EPOCH)  # fixed timestamps and modes: reproducible bytes
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, entries[arc].read_bytes())
    return buf.getvalue()


def code_sha256(zip_bytes: bytes) -> str:
    """Lambda's CodeSha256 of a zip: base64 of its SHA-256."""
    return base64.b64encode(hashlib.sha256(zip_bytes).digest()).decode()


def deploy_zip(
    client,
    function_name: str,
    zip_bytes: bytes,
    handler: str,
    role_arn: str | None = None,
    timeout: int = 30,
    memory: int = 512,
    concurrency: int | None = None,
    runtime: str = "python3.12",
    environment: dict | None = None,
    description: str = "",
    wait: bool = True,
) -> dict:
    """Create the function, or update its code and configuration where they differ (AWS or local).

    concurrency: reserved concurrency to set (None leaves it as it is). Returns
    {"action": "created"|"updated"|"unchanged", "function_arn", "code_sha256", "configuration"}.
    """
    aws = is_aws_endpoint(client.meta.endpoint_url)
    if role_arn is None:
        if aws:
            raise ValueError("role_arn is required to deploy to AWS Lambda (an IAM role the function runs as)")
        role_arn = LOCAL_ROLE
    sha = code_sha256(zip_bytes)
    wanted = {
        "Handler": handler,
        "Runtime": runtime,
        "Role": role_arn,
        "Timeout": int(timeout),
        "MemorySize": int(memory),
        "Environment": {"Variables": dict(environment or {})},
        "Description": description,
    }
    waiter_cfg = {"Delay": 1, "MaxAttempts": 300}
    try:
        current = client.get_function(FunctionName=function_name)["Configuration"]
    except client.exceptions.ResourceNotFoundException:
        current = None
    if current is None:
        cfg = client.create_function(FunctionName=function_name, Code={"ZipFile": zip_bytes}, PackageType="Zip", **wanted)
        action = "created"
        if wait:
            client.get_waiter("function_active_v2").wait(FunctionName=function_name, WaiterConfig=waiter_cfg)
    else:
        action = "unchanged"
        cfg = current
        if current.get("CodeSha256") != sha:
            cfg = client.update_function_code(FunctionName=function_name, ZipFile=zip_bytes)
            action = "updated"
            if wait:  # AWS refuses a configuration update while the code update is in progress
                client.get_waiter("function_updated_v2").wait(FunctionName=function_name, WaiterConfig=waiter_cfg)
        have = {k: current.get(k) for k in wanted}
        have["Environment"] = {"Variables": (current.get("Environment") or {}).get("Variables", {})}
        have["Description"] = current.get("Description", "")
        if have != wanted:
            cfg = client.update_function_configuration(FunctionName=function_name, **wanted)
            action = "updated"
            if wait:
                client.get_waiter("function_updated_v2").wait(FunctionName=function_name, WaiterConfig=waiter_cfg)
    if concurrency is not None:
        client.put_function_concurrency(FunctionName=function_name, ReservedConcurrentExecutions=int(concurrency))
    cfg = {k: v for k, v in cfg.items() if k != "ResponseMetadata"}
    return {"action": action, "function_arn": cfg.get("FunctionArn"), "code_sha256": sha, "configuration": cfg}


def deploy(
    function_name: str,
    reward: str,
    client,
    role_arn: str | None = None,
    timeout: int = 30,
    memory: int = 512,
    concurrency: int | None = None,
    runtime: str = "python3.12",
    environment: dict | None = None,
    root: str | Path | None = None,
    include=None,
    extra_dirs=(),
    wait: bool = True,
) -> dict:
    """Package ``reward`` (a registry name like 'math' or a module like 'rollart_dask.rewards.reasoning') and
    create-or-update the Lambda function ``function_name`` with handler ``<module>.handler``.
    A stateful reward (its module sets ``NEEDS_ENGINE``, e.g. the judge) is refused: it needs an
    inference engine and runs on the REWARD pool."""
    import importlib

    try:
        module = importlib.import_module(reward_module(reward))
    except ImportError:
        module = None  # build_zip names what is missing
    if getattr(module, "NEEDS_ENGINE", False):
        raise ValueError(
            f"reward {reward!r} is stateful (needs an inference engine): it runs on the REWARD pool and cannot be "
            "deployed as a Lambda function"
        )
    zip_bytes = build_zip(reward, root=root, include=include, extra_dirs=extra_dirs)
    handler = handler_for(reward)
    if module is not None and not callable(getattr(module, "handler", None)):  # a decorated reward: the generic handler calls it
        from rollart_dask.declare import TARGET_ENV, handler as generic

        handler = f"{generic.__module__}.{generic.__name__}"
        environment = {**(environment or {}), TARGET_ENV: reward_target(reward)}
    return deploy_zip(
        client,
        function_name,
        zip_bytes,
        handler,
        role_arn=role_arn,
        timeout=timeout,
        memory=memory,
        concurrency=concurrency,
        runtime=runtime,
        environment=environment,
        description=f"rollart reward {reward_module(reward)}",
        wait=wait,
    )


def delete(function_name: str, client, missing_ok: bool = True) -> bool:
    """Delete the function; False when it did not exist (and missing_ok)."""
    try:
        client.delete_function(FunctionName=function_name)
        return True
    except client.exceptions.ResourceNotFoundException:
        if not missing_ok:
            raise
        return False
