"""``zmqflow deploy k8s``: manifests that Kubernetes' own schemas accept (strict), whose parts
agree with each other and with the cluster spec they carry, and whose pod logic runs for real."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from zmqflow.cli.main import main
from zmqflow.cluster import ClusterSpec, TaskId, resolve, task_from_pod
from zmqflow.deploy.k8s import (CLUSTER_KEY, KEYS_DIR, PORT_NAME, SECRET_FILES, K8sOptions, probe_command, render,
                                render_yaml)
from zmqflow.errors import ConfigError, InvalidArgument
from zmqflow.ports import free_port

kv = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("1.27", "1.37")  # the oldest cluster we claim (Indexed Jobs, pod DNS for Job pods) and the newest schema
SHAPES = [
    dict(workers=1, ps=1),
    dict(workers=3, ps=2, chief=True, gpus=2),
    dict(workers=2, ps=0),
    dict(workers=4, ps=1, chief=True, insecure=True, name="exp-7", namespace="ml-team", port=4000),
    dict(workers=1, ps=3, keys_secret="team-keys", cpu="500m", memory="512Mi", command=("python", "train.py", "-v")),
    dict(workers=2, ps=2, ps_statefulset=True, checkpoint_claim="ckpt-rwx"),
    dict(workers=2, ps=1, chief=True, checkpoint_claim="ckpt", checkpoint_dir="/data/ckpt", insecure=True),
    dict(workers=1, ps=1, fs_group=None),
]


def opts_of(shape: dict[str, Any]) -> K8sOptions:
    return K8sOptions(image="ghcr.io/acme/train:1.2", **shape)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def check_consistency(docs: list[dict[str, Any]], opts: K8sOptions) -> None:
    """Every cross-field rule Kubernetes' schemas cannot express."""
    (svc,) = by_kind(docs, "Service")
    (cm,) = by_kind(docs, "ConfigMap")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
    assert all(d["metadata"]["namespace"] == ns for d in docs)
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["name"] == PORT_NAME and svc_port["targetPort"] == PORT_NAME
    spec = ClusterSpec.from_json(cm["data"][CLUSTER_KEY])
    workloads: dict[str, dict[str, Any]] = {}
    for sts in by_kind(docs, "StatefulSet"):
        assert sts["spec"]["serviceName"] == name
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
        workloads[labels["app.kubernetes.io/component"]] = sts
        assert opts.ps_statefulset and labels["app.kubernetes.io/component"] == "ps"
        assert sts["spec"]["replicas"] == spec.num_tasks("ps")
    for job in by_kind(docs, "Job"):
        s = job["spec"]
        assert s["completionMode"] == "Indexed" and s["template"]["spec"]["subdomain"] == name
        assert "selector" not in s  # the Job controller makes its own
        component = s["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        assert s["completions"] == s["parallelism"] == spec.num_tasks(component)
        assert job["metadata"]["name"] == f"{name}-{component}"
        assert s["template"]["spec"]["restartPolicy"] == "OnFailure"  # a failed index restarts in place
        workloads[component] = job
    assert sorted(workloads) == sorted(spec.jobs)
    if "ps" in workloads:  # a ps Job ends with training; a StatefulSet (which restarts what exits) outlives it
        ps_env = {e["name"]: e.get("value") for e in workloads["ps"]["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert workloads["ps"]["kind"] == ("StatefulSet" if opts.ps_statefulset else "Job")
        assert ps_env.get("ZMQFLOW_EXIT_WHEN_DONE") == (None if opts.ps_statefulset else "1")
    for job_name, wl in workloads.items():
        pod = wl["spec"]["template"]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()  # the Service finds every pod
        (c,) = pod["spec"]["containers"]
        assert [p["name"] for p in c["ports"]] == [PORT_NAME] and c["ports"][0]["containerPort"] == svc_port["port"]
        env = {e["name"]: e for e in c["env"]}
        assert env["ZMQFLOW_TASK_JOB"]["value"] == job_name
        assert env["ZMQFLOW_CLUSTER"]["valueFrom"]["configMapKeyRef"] == {"name": cm["metadata"]["name"], "key": CLUSTER_KEY}
        assert env["ZMQFLOW_BIND_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert c["readinessProbe"]["exec"]["command"] == probe_command(job_name)
        assert c["resources"]["requests"] == {"cpu": opts.cpu, "memory": opts.memory}
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
        assert gpus == (opts.gpus if job_name != "ps" else 0)
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        assert volumes.keys() == mounts.keys()
        if opts.secret:
            assert "ZMQFLOW_INSECURE" not in env and env["ZMQFLOW_KEYS"]["value"] == KEYS_DIR
            vol = next(v for v in volumes.values() if "secret" in v)
            assert vol["secret"]["secretName"] == opts.secret
            assert vol["secret"]["defaultMode"] & 0o077 == 0  # zmqflow refuses a secret others can read
            assert [(i["key"], i["path"]) for i in vol["secret"]["items"]] == list(SECRET_FILES)
            assert mounts[vol["name"]] == {"name": vol["name"], "mountPath": KEYS_DIR, "readOnly": True}
        else:
            assert env["ZMQFLOW_INSECURE"]["value"] == "1"
            assert not any("secret" in v for v in volumes.values())
        # a non-root image reads its keys and writes checkpoints through the pods' fsGroup
        assert pod["spec"].get("securityContext") == ({"fsGroup": opts.fs_group, "fsGroupChangePolicy": "OnRootMismatch"}
                                                      if volumes and opts.fs_group else None)
        claims = [v for v in volumes.values() if "persistentVolumeClaim" in v]
        if opts.checkpoint_claim:  # every pod sees the same checkpoint directory, the ps tasks' root
            (vol,) = claims
            assert vol["persistentVolumeClaim"]["claimName"] == opts.checkpoint_claim
            assert mounts[vol["name"]]["mountPath"] == opts.checkpoint_dir == env["ZMQFLOW_CHECKPOINT_ROOTS"]["value"]
        else:
            assert not claims and "ZMQFLOW_CHECKPOINT_ROOTS" not in env
        # every address is the pod DNS name of its task under the headless Service, at the Service's port
        pods = wl["metadata"]["name"]
        for i in spec.task_indices(job_name):
            addr = spec.address(TaskId(job_name, i))
            assert (addr.host, addr.port) == (f"{pods}-{i}.{name}.{ns}.svc", svc_port["port"])
    if "ps" in workloads:
        assert workloads["ps"]["metadata"]["name"] == f"{name}-ps"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items() if k != "command"))
def test_manifests_validate_strictly_and_agree(shape: dict[str, Any]) -> None:
    opts = opts_of(shape)
    docs = render(opts)
    for doc in docs:
        for version in VERSIONS:
            kv.validate(doc, version, strict=True)
    check_consistency(docs, opts)
    assert list(yaml.safe_load_all(render_yaml(opts))) == docs  # the emitter writes what render made


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The check above can fail: strict mode refuses a field Kubernetes does not know."""
    docs = render(opts_of(SHAPES[0]))
    docs[-1]["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(docs[-1], VERSIONS[-1], strict=True)


def test_the_rendered_example_is_current() -> None:
    text = (ROOT / "deploy/k8s/example.yaml").read_text()
    first = text.splitlines()[0]
    assert first.startswith("# Rendered by: zmqflow deploy k8s ")
    argv = shlex.split(first.removeprefix("# Rendered by: zmqflow "))
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert result.stdout == text
    docs = list(yaml.safe_load_all(text))
    for doc in docs:
        kv.validate(doc, VERSIONS[-1], strict=True)


def test_yaml_emitter_quotes_what_yaml_would_misread() -> None:
    from zmqflow.deploy.yaml_text import dump_all

    tricky = {"a": ["yes", "no", "on", "null", "1", "0x1f", "1e3", "-x", "a: b", "#c", "", " lead", "tab\tin",
                    "multi\nline\n", "multi\nno end", "é", "*ref", "&anchor", "!tag", "[x]", "{y}", "%z", "@w", "`v"],
              "n": 3, "t": True, "f": 1.5, "empty": {}, "none": [], "nested": [[1, 2], {"k": "v"}]}
    assert next(yaml.safe_load_all(dump_all([tricky]))) == tricky


def test_cli_bad_values_exit_2_with_one_line() -> None:
    runner = CliRunner()
    cases = [
        (["--workers", "0"], "workers 0"),
        (["--ps", "-1"], "ps -1"),
        (["--image", "Not An Image"], "image 'Not An Image'"),
        (["--name", "Bad_Name"], "name 'Bad_Name' is not a DNS-1123 label"),
        (["--name", "x" * 41], "at most 40"),
        (["--namespace", "-ns"], "namespace '-ns'"),
        (["--gpus", "-2"], "gpus -2"),
        (["--port", "70000"], "port 70000"),
        (["--memory", "lots"], "memory 'lots'"),
        (["--command", "'unbalanced"], "command"),
        (["--insecure", "--keys-secret", "k"], "exclude each other"),
    ]
    for extra, needle in cases:
        result = runner.invoke(main, ["deploy", "k8s", "--image", "img:1", *extra])
        assert result.exit_code == 2, (extra, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("zmqflow deploy k8s: ") and needle in lines[0], (extra, lines)
        assert result.stdout == ""


def test_cli_writes_output_file_and_warns_when_insecure(tmp_path: Path) -> None:
    out = tmp_path / "m.yaml"
    result = CliRunner().invoke(main, ["deploy", "k8s", "--image", "img:1", "--insecure", "--output", str(out)])
    assert result.exit_code == 0 and result.stdout == ""
    assert "--insecure" in result.stderr
    text = out.read_text()
    assert "WARNING: --insecure" in text and "ZMQFLOW_INSECURE" in text and "secretName" not in text


def test_options_refuse_bad_values_typed() -> None:
    with pytest.raises(InvalidArgument, match="workers True"):
        K8sOptions(image="img", workers=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="image"):
        K8sOptions(image="UPPER/case")
    with pytest.raises(InvalidArgument, match="fs group"):
        K8sOptions(image="img", fs_group=-5)
    with pytest.raises(InvalidArgument, match="name '2zf' must start with a letter: it names the cluster's Service"):
        K8sOptions(image="img", name="2zf")


# --- how a pod finds its task ----------------------------------------------------------------

def test_task_from_pod() -> None:
    assert task_from_pod({"ZMQFLOW_TASK_JOB": "worker", "JOB_COMPLETION_INDEX": "3", "HOSTNAME": "w-x-9"}) == TaskId("worker", 3)
    assert task_from_pod({"ZMQFLOW_TASK_JOB": "ps", "HOSTNAME": "exp-7-ps-12"}) == TaskId("ps", 12)
    assert task_from_pod({"ZMQFLOW_TASK_JOB": "ps", "ZMQFLOW_TASK_INDEX": "1", "JOB_COMPLETION_INDEX": "3"}) == TaskId("ps", 1)
    with pytest.raises(ConfigError, match="needs an index"):
        task_from_pod({"ZMQFLOW_TASK_JOB": "ps", "HOSTNAME": "laptop"})
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX"):
        task_from_pod({"ZMQFLOW_TASK_JOB": "ps", "JOB_COMPLETION_INDEX": "-1"})
    with pytest.raises(ConfigError, match="not a job name"):
        task_from_pod({"ZMQFLOW_TASK_JOB": "1ps", "HOSTNAME": "a-1"})
    spec = {"ps": ["a:1", "b:1"], "worker": ["c:1"]}
    env = {"ZMQFLOW_CLUSTER": json.dumps(spec), "ZMQFLOW_TASK_JOB": "ps", "HOSTNAME": "zf-ps-1"}
    assert resolve(env=env)[1] == TaskId("ps", 1)
    assert resolve(env={**env, "ZMQFLOW_TASK": "worker:0"})[1] == TaskId("worker", 0)  # an explicit task wins


def test_probe_command_names_the_pods_own_task(tmp_path: Path) -> None:
    """The probe's shell computes the index as task_from_pod does (a stand-in zmqflow echoes its argv)."""
    (tmp_path / "zmqflow").write_text('#!/bin/sh\necho "$@"\n')
    (tmp_path / "zmqflow").chmod(0o755)
    base = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    for env, want in (({"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "zf-worker-2"}, "worker:2"),
                      ({"HOSTNAME": "exp-7-worker-11"}, "worker:11")):
        out = subprocess.run(probe_command("worker"), env={**base, **env}, capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["status", "--task", want, "--timeout", "1"]
        assert task_from_pod({"ZMQFLOW_TASK_JOB": "worker", **env}) == TaskId.parse(want)


# --- the pods' logic, run for real on loopback ---------------------------------------------------

def _secret_volume(tmp_path: Path) -> Path:
    """A key directory laid out as the Secret volume mounts it (items to paths, mode 0400)."""
    from zmqflow.transport.curve import generate

    generated, mounted = tmp_path / "generated", tmp_path / "mounted"
    generate(generated)
    sources = {"allow.json": generated / "allow.json", "task.key_secret": generated / "tasks/task.key_secret",
               "client.key_secret": generated / "clients/client.key_secret"}
    for key, path in SECRET_FILES:
        target = mounted / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(sources[key].read_bytes())
        target.chmod(stat.S_IRUSR)
    return mounted


def test_pods_find_their_tasks_and_serve(tmp_path: Path, procs: Any) -> None:
    """Each pod's container command and env, as rendered, started as processes: the cluster spec
    rewritten to loopback ports, the index from JOB_COMPLETION_INDEX or the StatefulSet host name,
    keys from the Secret's layout. Every task comes up as itself and answers with keys."""
    opts = K8sOptions(image="img:1", workers=2, ps=2, chief=True)
    docs = render(opts)
    spec = json.loads(by_kind(docs, "ConfigMap")[0]["data"][CLUSTER_KEY])
    local = {job: [f"127.0.0.1:{free_port()}" for _ in addrs] for job, addrs in spec.items()}
    keys = _secret_volume(tmp_path)
    started = []
    for wl in by_kind(docs, "StatefulSet") + by_kind(docs, "Job"):
        (c,) = wl["spec"]["template"]["spec"]["containers"]
        job = {e["name"]: e for e in c["env"]}["ZMQFLOW_TASK_JOB"]["value"]
        assert c["command"] == ["zmqflow", "serve"]
        count = wl["spec"].get("replicas") or wl["spec"]["completions"]
        for i in range(count):
            pod = ({"HOSTNAME": f"{wl['metadata']['name']}-{i}"} if wl["kind"] == "StatefulSet"
                   else {"JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"{wl['metadata']['name']}-{i}-abcde"})
            env = {"ZMQFLOW_CLUSTER": json.dumps(local), "ZMQFLOW_TASK_JOB": job, "ZMQFLOW_BIND_HOST": "127.0.0.1",
                   "ZMQFLOW_KEYS": str(keys), **pod}
            started.append((f"{job}:{i}", procs([sys.executable, "-m", "zmqflow", *c["command"][1:]], env=env)))
    for task, p in started:
        p.wait_for_line(f"serving {task} at", 60)
    status = subprocess.run([sys.executable, "-m", "zmqflow", "status", "--json", "--timeout", "10"],
                            env={**os.environ, "ZMQFLOW_CLUSTER": json.dumps(local), "ZMQFLOW_KEYS": str(keys)},
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    rows = json.loads(status.stdout)["tasks"]
    assert sorted(r["task"] for r in rows if r["reachable"]) == sorted(t for t, _ in started)
    # each answered as the task its address names (not merely some task)
    assert all(r["address"] == local[r["task"].split(":")[0]][int(r["task"].split(":")[1])] for r in rows)
    for _, p in started:
        p.signal(15)
    for _, p in started:
        assert p.wait(10) == 0


TRAIN = """
import numpy as np, zmqflow as zf
with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(), hooks=[zf.StopAtStep(30)], progress=False) as mon:
    mon.create({"w": np.zeros(4)}, optimizer=zf.optim.SGD(0.1))
    while not mon.should_stop():
        mon.params()
        mon.apply({"w": np.ones(4)})
print("trained", flush=True)
"""


def test_a_rendered_job_trains_and_every_pod_completes(tmp_path: Path, procs: Any) -> None:
    """The default manifests as a run: chief and workers run a training script, ps tasks serve
    with the env they are rendered with (ZMQFLOW_EXIT_WHEN_DONE among it), each pod finding its
    task from its index and presenting the shared task key from the Secret's layout. When
    training ends, every process exits 0 by itself: each Job would complete."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    opts = K8sOptions(image="img:1", workers=2, ps=2, chief=True, command=("python", str(script)))
    docs = render(opts)
    spec = json.loads(by_kind(docs, "ConfigMap")[0]["data"][CLUSTER_KEY])
    local = {job: [f"127.0.0.1:{free_port()}" for _ in addrs] for job, addrs in spec.items()}
    keys = _secret_volume(tmp_path)
    started = []
    assert not by_kind(docs, "StatefulSet")
    for wl in by_kind(docs, "Job"):
        (c,) = wl["spec"]["template"]["spec"]["containers"]
        rendered = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        job = rendered["ZMQFLOW_TASK_JOB"]
        argv = [sys.executable, "-m", "zmqflow", *c["command"][1:]] if job == "ps" else [sys.executable, *c["command"][1:]]
        for i in range(wl["spec"]["completions"]):
            env = {**rendered, "ZMQFLOW_CLUSTER": json.dumps(local), "ZMQFLOW_BIND_HOST": "127.0.0.1",
                   "ZMQFLOW_KEYS": str(keys), "JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"{wl['metadata']['name']}-{i}-x"}
            started.append((f"{job}:{i}", procs(argv, env=env)))
    for task, p in started:
        assert p.wait(90) == 0, f"{task} did not complete:\n{p.output}"
    trainers = [p for task, p in started if not task.startswith("ps:")]
    assert all("trained" in p.output for p in trainers)
    assert all("finished training" in p.output for task, p in started if task.startswith("ps:"))


# --- the Kubeflow TFJob example ------------------------------------------------------------------

def _tfjob() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy/k8s/tfjob.yaml").read_text())


def test_tfjob_example_structure_and_pod_templates() -> None:
    job = _tfjob()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
    replicas = job["spec"]["tfReplicaSpecs"]
    assert set(replicas) == {"PS", "Chief", "Worker"}
    for rtype, rs in replicas.items():
        assert isinstance(rs["replicas"], int) and rs["replicas"] >= 1
        assert rs["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        template = rs["template"]
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t-{rtype.lower()}"},
                     "template": template}, VERSIONS[-1], strict=True)
        (c,) = template["spec"]["containers"]
        assert c["name"] == "tensorflow"  # the operator's default container name
        assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("tfjob-port", 2222)]
        env = {e["name"]: e for e in c["env"]}
        assert "ZMQFLOW_CLUSTER" not in env and "ZMQFLOW_TASK" not in env  # TF_CONFIG says it all
        assert env["ZMQFLOW_KEYS"]["value"] == KEYS_DIR
        (vol,) = template["spec"]["volumes"]
        assert [(i["key"], i["path"]) for i in vol["secret"]["items"]] == list(SECRET_FILES)
        assert vol["secret"]["defaultMode"] & 0o077 == 0
        assert c["command"] == (["zmqflow", "serve"] if rtype == "PS" else ["python", "train.py"])


def test_tf_config_from_the_operator_drives_zmqflow_unchanged() -> None:
    """TF_CONFIG as the training operator sets it for each replica of the example resolves to the
    same cluster everywhere and to that replica's own task."""
    job = _tfjob()
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    replicas = job["spec"]["tfReplicaSpecs"]
    cluster = {rtype.lower(): [f"{name}-{rtype.lower()}-{i}.{ns}.svc:2222" for i in range(rs["replicas"])]
               for rtype, rs in replicas.items()}
    specs = set()
    for rtype, rs in replicas.items():
        for i in range(rs["replicas"]):
            tf_config = {"cluster": cluster, "task": {"type": rtype.lower(), "index": i}, "environment": "cloud"}
            spec, task = resolve(env={"TF_CONFIG": json.dumps(tf_config)})
            assert task == TaskId(rtype.lower(), i)
            assert spec.address(task).host == f"{name}-{rtype.lower()}-{i}.{ns}.svc"
            specs.add(spec.to_json())
    assert len(specs) == 1
    assert sorted(ClusterSpec.from_json(specs.pop()).jobs) == ["chief", "ps", "worker"]


def test_example_shapes_need_keys_by_default() -> None:
    opts = K8sOptions(image="img:1")
    assert opts.secret == "zmqflow-keys" and not opts.insecure
    text = render_yaml(opts)
    assert "kubectl -n default create secret generic zmqflow-keys" in text
    for key, path in SECRET_FILES:
        assert f"--from-file={key}=keys/{path}" in text


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ZMQFLOW_CLUSTER", "ZMQFLOW_TASK", "ZMQFLOW_TASK_JOB", "TF_CONFIG", "ZMQFLOW_KEYS"):
        monkeypatch.delenv(var, raising=False)
