"""Kubernetes manifests for a zmqflow cluster, rendered from a few options.

What runs where, and why:

- one headless Service named ``name`` with ``publishNotReadyAddresses``: every pod gets a stable
  DNS name (``NAME-ps-0.NAME.NAMESPACE.svc``) from the moment it exists, not when it is ready, so
  tasks can find each other while they start;
- the cluster spec as a ConfigMap (``NAME-cluster``, key ``cluster.json``), handed to every pod as
  ``ZMQFLOW_CLUSTER``; its addresses are those DNS names, so no pod has to publish anything;
- chief, workers and ps tasks as Indexed Jobs ``NAME-chief``, ``NAME-worker`` and ``NAME-ps``: with
  ``subdomain`` set to the Service, an Indexed Job's pod is named ``JOB-<index>`` in DNS, and the
  Job ends when every index has exited 0 (a failed one is restarted in place). ps tasks run with
  ``ZMQFLOW_EXIT_WHEN_DONE=1``: they exit 0 once the chief and every worker finished training,
  so a finished run completes and frees its nodes (TF's ps tasks never exit: tensorflow#4713);
- or, with ``ps_statefulset``, ps tasks as a StatefulSet ``NAME-ps`` (pods ``NAME-ps-<ordinal>``,
  started in parallel) that keeps serving after training: its shards hold the trained variables
  for whoever reads them, and since a StatefulSet restarts a pod that exits, these ps tasks are
  not told to exit when the workers are done (``kubectl delete -f`` ends them);
- with ``checkpoint_claim``, a PersistentVolumeClaim (ReadWriteMany: ps shards write their files,
  the chief the manifest) mounted at ``checkpoint_dir`` in every pod, which is the ps tasks'
  checkpoint root (``ZMQFLOW_CHECKPOINT_ROOTS``); without it ps tasks refuse saves;
- every pod finds its own task: ``ZMQFLOW_TASK_JOB`` names the job and :func:`zmqflow.cluster.
  task_from_pod` takes the index from ``JOB_COMPLETION_INDEX`` or the StatefulSet ordinal;
- a server binds its pod IP (``ZMQFLOW_BIND_HOST`` from the downward API): its own DNS name may
  not resolve until the pod is published;
- readiness is ``zmqflow status --task JOB:INDEX --timeout 1``: the task answers its own probe;
- CurveZMQ keys from a Secret (on by default, since tasks listen on pod addresses that every pod
  of the cluster network reaches): a shared task keypair and the client keypair, as
  ``zmqflow keys generate DIR`` writes them without ``--cluster``. One pod template serves every
  index of a job, so each pod would carry every task's secret anyway: per-task keys would pin
  nothing here.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..cluster import ClusterSpec
from ..errors import InvalidArgument

__all__ = ["K8sOptions", "render", "render_yaml", "cluster_spec", "secret_commands", "KEYS_DIR", "PORT_NAME",
           "CLUSTER_KEY", "probe_command"]

KEYS_DIR = "/etc/zmqflow/keys"
PORT_NAME = "zmqflow"
CLUSTER_KEY = "cluster.json"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MAX_NAME = 40  # the longest pod name is NAME-worker-<index>: a DNS label (63) leaves room for this
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
# a registry is named as a host (a dot, a port, or localhost); the path after it is lower-case
_REGISTRY = r"(?:(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)(?::[0-9]+)?|[A-Za-z0-9-]+:[0-9]+)/"
_IMAGE = re.compile(rf"^(?:{_REGISTRY})?{_COMPONENT}(?:/{_COMPONENT})*"
                    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")
_ABS_PATH = re.compile(r"^/[A-Za-z0-9._/-]*$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
# the Secret's keys and where each lands in the key directory (zmqflow.transport.curve's layout)
SECRET_FILES = (("allow.json", "allow.json"), ("task.key_secret", "tasks/task.key_secret"),
                ("client.key_secret", "clients/client.key_secret"))


@dataclass(frozen=True)
class K8sOptions:
    """What a deployment is made of. ``command``: what chief and workers run (the training
    script; default ``zmqflow serve``); ps tasks always run ``zmqflow serve``."""

    image: str
    workers: int = 1
    ps: int = 1
    chief: bool = False
    gpus: int = 0
    name: str = "zmqflow"
    namespace: str = "default"
    keys_secret: str | None = None  # None: NAME-keys
    insecure: bool = False
    cpu: str = "1"
    memory: str = "2Gi"
    port: int = 2222
    command: tuple[str, ...] = field(default_factory=tuple)
    ps_statefulset: bool = False  # ps as a StatefulSet that outlives training, not a Job that ends with it
    checkpoint_claim: str | None = None  # a ReadWriteMany PVC mounted at checkpoint_dir in every pod
    checkpoint_dir: str = "/checkpoints"
    fs_group: int | None = 2000  # the pods' fsGroup: a non-root image can read the keys and write checkpoints

    def __post_init__(self) -> None:
        _check_int("workers", self.workers, 1)
        _check_int("ps", self.ps, 0)
        _check_int("gpus", self.gpus, 0)
        _check_int("port", self.port, 1, 65535)
        if self.fs_group is not None:
            _check_int("fs group", self.fs_group, 1, 2**31 - 1)
        _check_label("name", self.name, _MAX_NAME)
        if not self.name[:1].isalpha():  # it names a Service too: a DNS-1035 label, which starts with a letter
            raise InvalidArgument(f"name {self.name!r} must start with a letter: it names the cluster's Service, "
                                  "a DNS-1035 label")
        _check_label("namespace", self.namespace, 63)
        if self.keys_secret is not None:
            _check_label("keys secret", self.keys_secret, 253)
            if self.insecure:
                raise InvalidArgument("a keys secret and insecure exclude each other")
        if not isinstance(self.image, str) or not _IMAGE.match(self.image):
            raise InvalidArgument(f"image {self.image!r} is not an image reference like 'registry/repo/name:tag'")
        for what, value in (("cpu", self.cpu), ("memory", self.memory)):
            if not isinstance(value, str) or not _QUANTITY.match(value):
                raise InvalidArgument(f"{what} {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)")
        if self.checkpoint_claim is not None:
            _check_label("checkpoint claim", self.checkpoint_claim, 253)
        if not isinstance(self.checkpoint_dir, str) or not _ABS_PATH.match(self.checkpoint_dir) \
                or self.checkpoint_dir.rstrip("/") in ("", KEYS_DIR) or KEYS_DIR.startswith(self.checkpoint_dir.rstrip("/") + "/"):
            raise InvalidArgument(f"checkpoint dir {self.checkpoint_dir!r}: expected an absolute path apart from {KEYS_DIR}")
        if not all(isinstance(a, str) and a for a in self.command):
            raise InvalidArgument(f"command {self.command!r}: expected non-empty strings")
        for arg in self.command:  # a process argument is a C string of (here) UTF-8 text
            if "\x00" in arg or not _is_utf8(arg):
                raise InvalidArgument(f"command argument {arg!r}: expected UTF-8 text without NUL characters")

    @property
    def secret(self) -> str | None:
        """The keys Secret's name, None when insecure."""
        return None if self.insecure else (self.keys_secret or f"{self.name}-keys")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_int(what: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidArgument(f"{what} {value!r}: expected an integer {bound}")


def _check_label(what: str, value: object, longest: int) -> None:
    if not isinstance(value, str) or not _DNS_LABEL.match(value) or len(value) > longest:
        raise InvalidArgument(f"{what} {value!r} is not a DNS-1123 label of at most {longest} characters "
                              "(lower-case letters, digits and '-', starting and ending with a letter or digit)")


def jobs(opts: K8sOptions) -> list[tuple[str, int]]:
    """The cluster's jobs in order, with their task counts."""
    out = [("chief", 1)] if opts.chief else []
    out.append(("worker", opts.workers))
    if opts.ps:
        out.append(("ps", opts.ps))
    return out


def host(opts: K8sOptions, job: str, index: int) -> str:
    """A task's stable DNS name: its pod's hostname under the headless Service."""
    return f"{opts.name}-{job}-{index}.{opts.name}.{opts.namespace}.svc"


def cluster_spec(opts: K8sOptions) -> ClusterSpec:
    return ClusterSpec({job: [f"{host(opts, job, i)}:{opts.port}" for i in range(n)] for job, n in jobs(opts)})


def probe_command(job: str) -> list[str]:
    """The readiness probe: the pod's own task must answer (its index computed as the server does)."""
    index = "${ZMQFLOW_TASK_INDEX:-${JOB_COMPLETION_INDEX:-${HOSTNAME##*-}}}"
    return ["sh", "-c", f'exec zmqflow status --task "{job}:{index}" --timeout 1']


def _labels(opts: K8sOptions, job: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "zmqflow", "app.kubernetes.io/instance": opts.name}
    if job is not None:
        labels["app.kubernetes.io/component"] = job
    return labels


def _meta(opts: K8sOptions, name: str, job: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": opts.namespace, "labels": _labels(opts, job)}


def _pod(opts: K8sOptions, job: str) -> dict[str, Any]:
    """The pod template every task of ``job`` shares."""
    env: list[dict[str, Any]] = [
        {"name": "ZMQFLOW_CLUSTER", "valueFrom": {"configMapKeyRef": {"name": f"{opts.name}-cluster", "key": CLUSTER_KEY}}},
        {"name": "ZMQFLOW_TASK_JOB", "value": job},
        {"name": "ZMQFLOW_BIND_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    env.append({"name": "ZMQFLOW_KEYS", "value": KEYS_DIR} if opts.secret else {"name": "ZMQFLOW_INSECURE", "value": "1"})
    if job == "ps" and not opts.ps_statefulset:
        env.append({"name": "ZMQFLOW_EXIT_WHEN_DONE", "value": "1"})  # the ps Job completes when training has
    if opts.checkpoint_claim:
        env.append({"name": "ZMQFLOW_CHECKPOINT_ROOTS", "value": opts.checkpoint_dir})
    resources: dict[str, Any] = {"requests": {"cpu": opts.cpu, "memory": opts.memory}}
    if opts.gpus and job != "ps":
        resources["limits"] = {"nvidia.com/gpu": opts.gpus}
    command = list(opts.command) if opts.command and job != "ps" else ["zmqflow", "serve"]
    container: dict[str, Any] = {
        "name": "zmqflow",
        "image": opts.image,
        "command": command,
        "env": env,
        "ports": [{"name": PORT_NAME, "containerPort": opts.port, "protocol": "TCP"}],
        "resources": resources,
        "readinessProbe": {"exec": {"command": probe_command(job)}, "initialDelaySeconds": 2, "periodSeconds": 5,
                           "timeoutSeconds": 5, "failureThreshold": 3},
    }
    spec: dict[str, Any] = {"enableServiceLinks": False, "containers": [container]}
    if job != "ps" or not opts.ps_statefulset:
        spec["subdomain"] = opts.name  # Indexed Job pods are then JOB-INDEX.NAME in DNS
        spec["restartPolicy"] = "OnFailure"
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    if opts.secret:
        mounts.append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
        volumes.append({"name": "keys", "secret": {
            "secretName": opts.secret, "defaultMode": 0o400,  # secrets must not be readable by others
            "items": [{"key": key, "path": path} for key, path in SECRET_FILES]}})
    if opts.checkpoint_claim:
        mounts.append({"name": "checkpoints", "mountPath": opts.checkpoint_dir})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": opts.checkpoint_claim}})
    if mounts:
        container["volumeMounts"] = mounts
        spec["volumes"] = volumes
        if opts.fs_group is not None:
            # the kubelet gives the volumes this group (secret files become root-owned 0440, which
            # the key loader accepts), so an image that runs as a non-root user reads its keys
            spec["securityContext"] = {"fsGroup": opts.fs_group, "fsGroupChangePolicy": "OnRootMismatch"}
    return {"metadata": {"labels": _labels(opts, job)}, "spec": spec}


def render(opts: K8sOptions) -> list[dict[str, Any]]:
    """The manifests, in the order to apply them: Service, ConfigMap, ps (a Job, or a StatefulSet), Jobs."""
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(opts, opts.name), "spec": {
            "clusterIP": "None", "publishNotReadyAddresses": True, "selector": _labels(opts),
            "ports": [{"name": PORT_NAME, "port": opts.port, "targetPort": PORT_NAME, "protocol": "TCP"}]}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(opts, f"{opts.name}-cluster"),
         "data": {CLUSTER_KEY: json.dumps(cluster_spec(opts).as_dict(), indent=2) + "\n"}},
    ]
    for job, count in sorted(jobs(opts), key=lambda jc: jc[0] != "ps"):  # ps first: the others call it
        if job == "ps" and opts.ps_statefulset:
            docs.append({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(opts, f"{opts.name}-ps", job),
                         "spec": {"serviceName": opts.name, "replicas": count, "podManagementPolicy": "Parallel",
                                  "selector": {"matchLabels": _labels(opts, job)}, "template": _pod(opts, job)}})
        else:
            docs.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(opts, f"{opts.name}-{job}", job),
                         "spec": {"completionMode": "Indexed", "completions": count, "parallelism": count,
                                  "template": _pod(opts, job)}})
    return docs


def secret_commands(opts: K8sOptions, directory: str = "keys") -> list[str]:
    """How to make the keys Secret the manifests mount (empty when insecure)."""
    if not opts.secret:
        return []
    files = " ".join(f"--from-file={key}={directory}/{path}" for key, path in SECRET_FILES)
    return [f"zmqflow keys generate {directory}",
            f"kubectl -n {opts.namespace} create secret generic {opts.secret} {files}"]


def command_line(opts: K8sOptions) -> str:
    """The ``zmqflow deploy k8s`` command that renders ``opts``."""
    args = ["zmqflow", "deploy", "k8s", "--workers", str(opts.workers), "--ps", str(opts.ps), "--image", opts.image]
    if opts.chief:
        args.append("--chief")
    if opts.gpus:
        args += ["--gpus", str(opts.gpus)]
    for flag, value, default in (("--name", opts.name, "zmqflow"), ("--namespace", opts.namespace, "default"),
                                 ("--keys-secret", opts.keys_secret, None), ("--cpu", opts.cpu, "1"),
                                 ("--memory", opts.memory, "2Gi"), ("--port", opts.port, 2222)):
        if value != default:
            args += [flag, str(value)]
    if opts.insecure:
        args.append("--insecure")
    if opts.ps_statefulset:
        args.append("--ps-statefulset")
    if opts.checkpoint_claim:
        args += ["--checkpoint-claim", opts.checkpoint_claim]
        if opts.checkpoint_dir != "/checkpoints":
            args += ["--checkpoint-dir", opts.checkpoint_dir]
    if opts.command:
        args += ["--command", shlex.join(opts.command)]
    return " ".join(_shell_quote(arg) for arg in args)


def _shell_quote(arg: str) -> str:
    """``arg`` for a POSIX shell, on one line: what holds a line break or another unprintable
    character is written in bash's ``$'...'`` form, so the header's command stays one comment line
    that still reproduces the manifests when pasted."""
    if arg.isprintable():
        return shlex.quote(arg)
    named = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = []
    for char in arg:
        if char in named:
            out.append(named[char])
        elif char.isprintable():
            out.append(char)
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
    return "$'" + "".join(out) + "'"


def render_yaml(opts: K8sOptions) -> str:
    """The manifests as one YAML stream, headed by how they were made and how to make the Secret."""
    from .yaml_text import dump_all

    header = [f"Rendered by: {command_line(opts)}"]
    if opts.secret:
        header += ["Create the CurveZMQ keys Secret first (a shared task key and the client key):"]
        header += [f"  {line}" for line in secret_commands(opts)]
    else:
        header += ["WARNING: --insecure: no keys. Any pod that reaches these tasks can read and change the model."]
    header.append(f"Then: kubectl apply -f FILE; kubectl -n {opts.namespace} get pods "
                  f"-l app.kubernetes.io/instance={opts.name}")
    return dump_all(render(opts), header)
