"""Where a run is launched: the layout, and Slurm and Kubernetes settings (``launch.*``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from recipes.checks import one_of, positive, require
from recipes.gpus import find_gpu, known_gpus


@dataclass(kw_only=True)
class SlurmConfig:
    partition: Optional[str] = None  # #SBATCH --partition
    account: Optional[str] = None  # #SBATCH --account
    time_limit: str = "01:00:00"  # #SBATCH --time; a save and requeue happen before it
    signal_grace_s: int = 120  # --signal=B:USR1@<grace>: emergency-save window before the kill
    # Requeues after failures (infrastructure deaths, unhealthy nodes) before the job stops
    # for good; requeues after a time-limit or preemption save are planned and not counted.
    max_requeues: int = 3
    # Resources of each node's one task (the launcher and its ranks). None: all of the node
    # with --exclusive (the default on GPU nodes), else one CPU per rank.
    exclusive: Optional[bool] = None  # None: exclusive when launch.gpus_per_node > 0
    cpus_per_task: Optional[int] = None  # CPUs of each node's task (launcher and ranks)
    mem: Optional[str] = None  # --mem per node, e.g. 480G; None: all of it (0) when exclusive
    # Exclusion of failed or unhealthy nodes on requeue: at most this many per job, and never
    # so many that the partition has fewer nodes left than the job needs.
    max_excluded_nodes: int = 2
    # A job may shrink to this many nodes when exclusions leave too few (the restore reshards
    # to the smaller data-parallel size); None: keep launch.nodes and wait for nodes.
    min_nodes: Optional[int] = None
    # Hot spares: the job also holds this many idle nodes; a node whose worker is killed leaves
    # the job and a spare takes its ranks without a requeue (ft_launcher only; docs/clusters.md)
    spare_nodes: int = 0
    # The python of the environment a job without container_image runs with, an absolute path
    # on the cluster's nodes (its bin dir's torchrun or ft_launcher starts the ranks; a GPU
    # job's preflight checks it on every node); None: the submitting environment's, with a
    # warning for a GPU job.
    python: Optional[str] = None
    container_image: Optional[str] = None  # pyxis --container-image
    # host:container[:flags]; the run dir, data and checkpoint dirs are added when missing
    container_mounts: list[str] = field(default_factory=list)
    # With container_image the image's installed code runs, from the run dir; true: the
    # submitting checkout is mounted at its path and the job starts there, so the checkout's
    # code runs (for development on a cluster; the manifest then records its commit).
    mount_code: bool = False
    container_workdir: Optional[str] = None  # None: the run dir (the checkout with mount_code)
    extra_sbatch: list[str] = field(default_factory=list)  # verbatim "#SBATCH" arguments
    env_passthrough: list[str] = field(default_factory=list)  # extra env vars exported to ranks
    env: dict[str, str] = field(default_factory=dict)  # set for every rank (NCCL_*, ...)

    def __post_init__(self) -> None:
        require(self.signal_grace_s >= 0, "launch.slurm.signal_grace_s must be >= 0")
        require(
            self.python is None or (self.python.startswith("/") and not self.python.endswith("/")),
            f"launch.slurm.python={self.python!r} must be the absolute path of a python "
            "executable as the cluster's nodes see it (e.g. /shared/envs/train/bin/python)",
        )
        require(
            self.python is None or not self.container_image,
            "launch.slurm.python and launch.slurm.container_image exclude each other: with an "
            "image the job runs the image's own environment; set one of them",
        )
        require(self.max_requeues >= 0, "launch.slurm.max_requeues must be >= 0")
        require(self.max_excluded_nodes >= 0, "launch.slurm.max_excluded_nodes must be >= 0")
        require(
            self.cpus_per_task is None or self.cpus_per_task >= 1,
            f"launch.slurm.cpus_per_task={self.cpus_per_task} must be >= 1 (or null)",
        )
        require(self.spare_nodes >= 0, "launch.slurm.spare_nodes must be >= 0")
        require(
            self.spare_nodes == 0 or self.min_nodes is None,
            "launch.slurm.spare_nodes and launch.slurm.min_nodes exclude each other: a job with "
            "spares replaces a failed node and never shrinks; set one of them",
        )
        require(
            self.min_nodes is None or self.min_nodes >= 1,
            f"launch.slurm.min_nodes={self.min_nodes} must be >= 1 (or null)",
        )
        require(
            self.mem is None or bool(re.fullmatch(r"\d+[KMGT]?", self.mem)),
            f"launch.slurm.mem={self.mem!r} is not a Slurm memory size (e.g. 0, 480G, 64000M)",
        )
        require(
            bool(re.fullmatch(r"(\d+-)?\d+(:\d{2}){0,2}", self.time_limit)),
            f"launch.slurm.time_limit={self.time_limit!r} is not a Slurm time "
            "(e.g. 04:00:00 or 2-00:00:00)",
        )

    @property
    def time_limit_s(self) -> int:
        """``time_limit`` in seconds, read as sbatch reads --time: M, M:S, H:M:S, D-H,
        D-H:M or D-H:M:S."""
        days, _, clock = self.time_limit.rpartition("-")
        parts = [int(p) for p in clock.split(":")]
        if days or len(parts) == 3:  # after a day count, or three fields: hours come first
            hours, minutes, seconds = (parts + [0, 0])[:3]
        else:  # one or two fields without days: minutes[:seconds]
            hours, minutes, seconds = 0, parts[0], (parts[1:] or [0])[0]
        return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


@dataclass(kw_only=True)
class K8sConfig:
    # pytorchjob: training-operator v1 (kubeflow.org/v1 PyTorchJob); trainjob: Kubeflow
    # Trainer v2 (a trainer.kubeflow.org/v1alpha1 TrainJob on a ClusterTrainingRuntime of its
    # own, a JobSet template: gang restart by the JobSet failure policy)
    api: str = "pytorchjob"
    # api=trainjob: an existing ClusterTrainingRuntime the TrainJob runs on instead of one of
    # its own (the image, command, env and resources go in the TrainJob, the pod's volumes and
    # placement in its runtimePatches; restarts and priority are that runtime's)
    runtime: Optional[str] = None
    # api=trainjob without launch.k8s.runtime, where the run's own runtime lives: namespace (a
    # TrainingRuntime beside the TrainJob: the namespace's rights suffice) or cluster (a
    # ClusterTrainingRuntime: needs the right to create cluster-scoped objects)
    runtime_scope: str = "namespace"
    image: Optional[str] = None  # container image with this repo installed (pin by digest)
    namespace: str = "default"  # Kubernetes namespace
    job_name: Optional[str] = None  # None: derived from run_id
    shared_pvc: Optional[str] = None  # RWX claim for the persistent checkpoint tier
    shared_mount: str = "/checkpoints"  # where the shared claim is mounted in pods
    # Node-local checkpoint tier (rendered only with checkpoint.local.interval set). hostPath
    # outlives the pod, so a pod the operator recreates on the same node finds its shards;
    # emptyDir goes with the pod (for namespaces whose Pod Security level forbids hostPath).
    local_volume: str = "hostPath"  # hostPath | emptyDir
    local_host_path: Optional[str] = None  # None: /var/lib/mcore-recipes/<namespace>/<job name>
    local_mount: str = "/local-ckpt"  # where the local tier is mounted in pods
    termination_grace_s: int = 180  # pod grace period: the emergency save's window
    backoff_limit: int = 3  # PyTorchJob runPolicy.backoffLimit; TrainJob: JobSet maxRestarts
    queue: Optional[str] = None  # gang scheduling queue (Volcano/Kueue)
    # api=trainjob: volcano puts the pods in a Volcano PodGroup (all start together or none;
    # launch.k8s.queue is then Volcano's queue, not Kueue's). None: Kueue admits the job
    # whole where launch.k8s.queue is set. A PyTorchJob's gang scheduler is the operator's.
    gang_scheduler: Optional[str] = None
    priority_class: Optional[str] = None  # pod priorityClassName
    # Kueue's WorkloadPriorityClass for the job (kueue.x-k8s.io/priority-class): the order of
    # admission and preemption among Kueue workloads, apart from the pods' priorityClassName.
    kueue_priority_class: Optional[str] = None
    # The pods tolerate only the taints launch.k8s.tolerations names: a toleration without a
    # key (every taint, a node problem detector's too) is refused, and on an existing runtime
    # (launch.k8s.runtime) one whose pods tolerate every taint is refused at submission.
    avoid_tainted: bool = True
    # Node names the pods are kept off (required anti-affinity), besides those whose health
    # check failed on hardware in an earlier attempt of the run (launch/k8s/isolation.py).
    avoid_nodes: list[str] = field(default_factory=list)
    # Per pod (one pod per node); requests are set equal to limits (Guaranteed QoS). Required
    # for GPU pods; e.g. a node's allocatable CPU and memory less what its daemons need.
    cpu: Optional[str] = None
    memory: Optional[str] = None  # per pod, requests = limits (e.g. 900Gi)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every rank
    tolerations: list[dict] = field(default_factory=list)  # pod tolerations, as in the pod API
    node_selector: dict[str, str] = field(default_factory=dict)  # node label -> value
    image_pull_secrets: list[str] = field(default_factory=list)  # Secret names in the namespace
    capabilities: list[str] = field(default_factory=list)  # Linux capabilities added: IPC_LOCK
    # Device-plugin resources per pod, as requests and limits: {rdma/ib: 1}. GPUs come from
    # launch.gpus_per_node (nvidia.com/gpu); cpu and memory from the keys above.
    extended_resources: dict[str, int] = field(default_factory=dict)
    # checkpoint.remote: a Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and, for an
    # S3-compatible store, AWS_ENDPOINT_URL), given to the trainer, its init container and the
    # uploader Deployment; None: the pods' own identity (an IAM role for service accounts).
    remote_secret: Optional[str] = None

    # Not fields (no annotation): the formats the API server checks, named in our messages.
    _QUANTITY = re.compile(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][0-9]+)?")
    _DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
    _LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
    _TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
    _EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

    def __post_init__(self) -> None:
        one_of("launch.k8s", "api", self.api, ("pytorchjob", "trainjob"))
        require(
            self.runtime is None
            or (self.api == "trainjob" and bool(self._DNS_SUBDOMAIN.fullmatch(self.runtime))),
            f"launch.k8s.runtime={self.runtime!r} names a ClusterTrainingRuntime: it needs "
            "launch.k8s.api=trainjob and a valid object name",
        )
        one_of("launch.k8s", "runtime_scope", self.runtime_scope, ("namespace", "cluster"))
        self._check_gang_scheduler()
        one_of("launch.k8s", "local_volume", self.local_volume, ("hostPath", "emptyDir"))
        require(
            self.local_host_path is None
            or (self.local_volume == "hostPath" and self.local_host_path.startswith("/")),
            f"launch.k8s.local_host_path={self.local_host_path!r} needs "
            "launch.k8s.local_volume=hostPath and an absolute path",
        )
        require(self.termination_grace_s >= 0, "launch.k8s.termination_grace_s must be >= 0")
        require(self.backoff_limit >= 0, "launch.k8s.backoff_limit must be >= 0")
        for key in ("cpu", "memory"):
            value = getattr(self, key)
            require(
                value is None or bool(self._QUANTITY.fullmatch(value)),
                f"launch.k8s.{key}={value!r} is not a Kubernetes quantity (e.g. 64, 500m, 900Gi)",
            )
        for i, toleration in enumerate(self.tolerations):
            self._check_toleration(f"launch.k8s.tolerations[{i}]", toleration)
            require(
                not self.avoid_tainted or bool(toleration.get("key")),
                f"launch.k8s.tolerations[{i}] has no key, so it tolerates every taint, a node "
                "problem detector's too: name the taints the pods may run on, or set "
                "launch.k8s.avoid_tainted=false",
            )
        require(
            self.kueue_priority_class is None
            or (
                self.queue is not None and self._object_name_ok(self.kueue_priority_class, limit=63)
            ),
            f"launch.k8s.kueue_priority_class={self.kueue_priority_class!r} names a Kueue "
            "WorkloadPriorityClass: it needs launch.k8s.queue and a valid object name of at "
            "most 63 characters (it goes in a label)",
        )
        for key, value in self.node_selector.items():
            require(
                self._label_key_ok(str(key))
                and len(str(value)) <= 63
                and (value == "" or bool(self._LABEL_NAME.fullmatch(str(value)))),
                f"launch.k8s.node_selector: {key!r}: {value!r} is not a node label key and value",
            )
        for name in self.image_pull_secrets:
            require(
                self._object_name_ok(name),
                f"launch.k8s.image_pull_secrets: {name!r} is not a Secret name",
            )
        for name in self.avoid_nodes:
            require(
                self._object_name_ok(name),
                f"launch.k8s.avoid_nodes: {name!r} is not a node name",
            )
        for cap in self.capabilities:
            require(
                bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", cap)) and not cap.startswith("CAP_"),
                f"launch.k8s.capabilities: {cap!r} is not a capability name as Kubernetes "
                "spells it (upper case, no CAP_ prefix, e.g. IPC_LOCK)",
            )
        self._check_extended_resources()

    def _check_gang_scheduler(self) -> None:
        if self.gang_scheduler is None:
            return
        one_of("launch.k8s", "gang_scheduler", self.gang_scheduler, ("volcano",))
        require(
            self.api == "trainjob" and self.runtime is None,
            "launch.k8s.gang_scheduler=volcano needs launch.k8s.api=trainjob and a runtime of "
            "the run's own (no launch.k8s.runtime: a TrainJob cannot set a runtime's "
            "podGroupPolicy); a PyTorchJob's gang scheduler is the training-operator's "
            "--gang-scheduler-name",
        )
        require(
            self.kueue_priority_class is None,
            "launch.k8s.kueue_priority_class is Kueue's; with launch.k8s.gang_scheduler=volcano "
            "the PodGroup takes its priority from launch.k8s.priority_class",
        )
        require(
            self.queue is None or self._object_name_ok(self.queue),
            f"launch.k8s.queue={self.queue!r} is not a Volcano Queue name (a DNS-1123 "
            "subdomain: lower case, digits, '-' and '.')",
        )

    def _object_name_ok(self, name: str, limit: int = 253) -> bool:
        """A Kubernetes object name: a DNS-1123 subdomain of at most ``limit`` characters."""
        return len(name) <= limit and bool(self._DNS_SUBDOMAIN.fullmatch(name))

    def _label_key_ok(self, key: str) -> bool:
        prefix, _, name = key.rpartition("/")
        return (
            (not prefix or self._object_name_ok(prefix))
            and len(name) <= 63
            and bool(self._LABEL_NAME.fullmatch(name))
        )

    def _check_toleration(self, where: str, tol: dict) -> None:
        unknown = sorted(set(map(str, tol)) - set(self._TOLERATION_KEYS))
        known = list(self._TOLERATION_KEYS)
        require(not unknown, f"{where}: unknown field(s) {unknown}; known: {known}")
        operator, effect = tol.get("operator", "Equal"), tol.get("effect", "")
        one_of(where, "operator", operator, ("Equal", "Exists"))
        require(
            effect in ("", *self._EFFECTS),
            f"{where}.effect={effect!r} is not one of {list(self._EFFECTS)}",
        )
        require(
            operator == "Equal" or not tol.get("value"),
            f"{where}: operator Exists takes no value",
        )
        require(
            bool(tol.get("key")) or operator == "Exists",
            f"{where}: without a key the operator must be Exists (tolerates every taint)",
        )
        seconds = tol.get("tolerationSeconds")
        require(
            seconds is None or (isinstance(seconds, int) and effect == "NoExecute"),
            f"{where}.tolerationSeconds needs effect NoExecute and an integer",
        )

    def _check_extended_resources(self) -> None:
        for name, count in self.extended_resources.items():
            require(
                "/" in name
                and self._label_key_ok(name)
                and not name.startswith(("kubernetes.io/", "requests.")),
                f"launch.k8s.extended_resources: {name!r} is not an extended resource name "
                "(a domain-prefixed name such as rdma/ib or nvidia.com/mig-1g.10gb)",
            )
            require(
                name != "nvidia.com/gpu",
                "launch.k8s.extended_resources: nvidia.com/gpu comes from launch.gpus_per_node",
            )
            require(count >= 1, f"launch.k8s.extended_resources.{name}={count} must be >= 1")


def _is_gib(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False


@dataclass(kw_only=True)
class LaunchConfig:
    backend: str = "torchrun"  # torchrun | ft_launcher
    nodes: int = 1  # nodes (one launcher each)
    # parallel.elastic: the fewest nodes the job keeps training on (None: launch.nodes)
    min_nodes: Optional[int] = None
    nproc_per_node: int = 1  # ranks per node
    gpus_per_node: int = 0  # 0: CPU; else one GPU per rank
    # A standby per node that has imported torch, megatron-core and the trainer and forks each
    # worker the launcher starts (restarts skip the imports; docs/fault-tolerance.md)
    standby: bool = False
    # The GPU the fit check plans for before a Slurm or Kubernetes submission (`python -m
    # pretrain --plan`): h100-80gb | h200-141gb | a100-80gb | a100-40gb | its memory in GiB.
    gpu: str = "h100-80gb"
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)

    def __post_init__(self) -> None:
        one_of("launch", "backend", self.backend, ("torchrun", "ft_launcher"))
        positive("launch", nodes=self.nodes, nproc_per_node=self.nproc_per_node)
        require(self.gpus_per_node >= 0, "launch.gpus_per_node must be >= 0")
        require(
            self.gpus_per_node in (0, self.nproc_per_node),
            f"launch.gpus_per_node={self.gpus_per_node} must be 0 (CPU) or equal "
            f"launch.nproc_per_node={self.nproc_per_node} (one rank per GPU)",
        )
        require(
            find_gpu(self.gpu) is not None or _is_gib(self.gpu),
            f"launch.gpu={self.gpu!r} must be one of {known_gpus()} or a memory in GiB",
        )
        require(
            self.min_nodes is None or 1 <= self.min_nodes <= self.nodes,
            f"launch.min_nodes={self.min_nodes} must be between 1 and launch.nodes={self.nodes}",
        )
        require(
            self.slurm.min_nodes is None or self.slurm.min_nodes <= self.nodes,
            f"launch.slurm.min_nodes={self.slurm.min_nodes} must be <= launch.nodes={self.nodes}",
        )
        require(
            self.slurm.spare_nodes == 0 or self.backend == "ft_launcher",
            f"launch.slurm.spare_nodes={self.slurm.spare_nodes} needs launch.backend=ft_launcher "
            "(its rendezvous keeps the spares waiting and lets a failed node leave)",
        )

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def slurm_exclusive(self) -> bool:
        """Whole nodes: asked for, or by default on GPU nodes (NeMo-Run's and Megatron-LM's
        Slurm scripts take whole GPU nodes too)."""
        return self.gpus_per_node > 0 if self.slurm.exclusive is None else self.slurm.exclusive
