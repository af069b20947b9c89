"""Code sandbox env: seeded Python function-writing problems checked by hidden tests in a sandbox.

``CodeSandboxEnv`` (env.py) is the env; ``problems.make_problem`` the generator; sandbox.py the
isolation backends (subprocess namespaces+rlimits, or Docker). Nothing here imports the runtime.
"""

from .env import CodeSandboxEnv, extract_code
from .problems import FAMILIES, Problem, make_problem
from .sandbox import DockerSandbox, Limits, RunResult, Sandbox, SandboxUnavailable, SubprocessSandbox, make_sandbox

__all__ = [
    "CodeSandboxEnv",
    "extract_code",
    "FAMILIES",
    "Problem",
    "make_problem",
    "DockerSandbox",
    "Limits",
    "RunResult",
    "Sandbox",
    "SandboxUnavailable",
    "SubprocessSandbox",
    "make_sandbox",
]
