"""``zmqflow deploy k8s``: print the Kubernetes manifests of a cluster (see zmqflow.deploy.k8s)."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from ..deploy.k8s import K8sOptions, render_yaml
from ..errors import InvalidArgument
from .common import EXIT_USAGE, fail

__all__ = ["deploy"]


@click.group()
def deploy() -> None:
    """Render deployment manifests for a cluster."""


@deploy.command("k8s")
@click.option("--workers", type=int, default=1, show_default=True, help="Worker tasks (an Indexed Job).")
@click.option("--ps", type=int, default=1, show_default=True, help="Parameter-server tasks (an Indexed Job that ends with training); 0 for none.")
@click.option("--image", required=True, help="Container image with zmqflow (and the training script) installed.")
@click.option("--chief", is_flag=True, help="Add a chief task (an Indexed Job of one).")
@click.option("--gpus", type=int, default=0, show_default=True, help="nvidia.com/gpu limit of each chief and worker pod.")
@click.option("--keys-secret", metavar="NAME", help="Secret holding the CurveZMQ keys (default NAME-keys).")
@click.option("--insecure", is_flag=True,
              help="No keys: tasks serve pod addresses unauthenticated and unencrypted. Only on a network you trust.")
@click.option("--name", default="zmqflow", show_default=True, help="Name of the Service and prefix of everything else.")
@click.option("--namespace", default="default", show_default=True)
@click.option("--port", type=int, default=2222, show_default=True, help="Port every task serves on.")
@click.option("--cpu", default="1", show_default=True, help="CPU request per pod.")
@click.option("--memory", default="2Gi", show_default=True, help="Memory request per pod.")
@click.option("--command", "command", metavar="CMD",
              help="What chief and workers run, e.g. 'python train.py --epochs 3' (default: zmqflow serve).")
@click.option("--ps-statefulset", is_flag=True,
              help="ps tasks as a StatefulSet that keeps serving after training (end it with kubectl delete).")
@click.option("--checkpoint-claim", metavar="PVC", help="A ReadWriteMany PersistentVolumeClaim for checkpoints, "
              "mounted in every pod at --checkpoint-dir (the ps tasks' checkpoint root).")
@click.option("--checkpoint-dir", default="/checkpoints", show_default=True, metavar="PATH",
              help="Where the checkpoint claim is mounted; pass it to your script as its checkpoint_dir.")
@click.option("--fs-group", type=int, default=2000, show_default=True, metavar="GID",
              help="The pods' fsGroup, so that images running as a non-root user can read the keys and write "
              "checkpoints; 0 leaves it out.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Write to this file instead of stdout.")
def k8s(workers: int, ps: int, image: str, chief: bool, gpus: int, keys_secret: str | None, insecure: bool, name: str,
        namespace: str, port: int, cpu: str, memory: str, ps_statefulset: bool, checkpoint_claim: str | None,
        checkpoint_dir: str, fs_group: int, command: str | None, output: str | None) -> None:
    """Print a headless Service, the cluster spec ConfigMap and Indexed Jobs for chief, workers and
    ps tasks (or a ps StatefulSet), with CurveZMQ keys from a Secret."""
    try:
        try:
            argv = tuple(shlex.split(command)) if command is not None else ()
        except ValueError as exc:
            raise InvalidArgument(f"command {command!r}: {exc}") from None
        if command is not None and not argv:
            raise InvalidArgument("command is empty")
        opts = K8sOptions(image=image, workers=workers, ps=ps, chief=chief, gpus=gpus, name=name, namespace=namespace,
                          keys_secret=keys_secret, insecure=insecure, cpu=cpu, memory=memory, port=port, command=argv,
                          ps_statefulset=ps_statefulset, checkpoint_claim=checkpoint_claim, checkpoint_dir=checkpoint_dir,
                          fs_group=fs_group or None)
    except InvalidArgument as exc:
        fail("deploy k8s", exc, EXIT_USAGE)
    text = render_yaml(opts)
    if insecure:
        click.echo("zmqflow deploy k8s: --insecure: these tasks accept anyone who reaches them", err=True)
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        Path(output).write_text(text)
    except OSError as exc:
        fail("deploy k8s", f"cannot write {output}: {exc.strerror or exc}", EXIT_USAGE)
