"""``zmqflow keys generate DIR [--cluster c.json]``: the CurveZMQ key material of a cluster."""

from __future__ import annotations

import click

from ..cluster import resolve
from ..errors import ConfigError
from ..transport.curve import ALLOW_FILE, generate as generate_keys
from .common import EXIT_USAGE, fail

__all__ = ["keys"]


@click.group()
def keys() -> None:
    """CurveZMQ keys: who may connect to a cluster's tasks, and as what."""


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--cluster", metavar="PATH|JSON", help="One keypair per task of this cluster (else one shared task keypair).")
@click.option("--force", is_flag=True, help="Replace the keys DIRECTORY already holds.")
def generate(directory: str, cluster: str | None, force: bool) -> None:
    """Write a keypair per task (or one shared task key), a client keypair and the allow-list.

    Secret files are created mode 0600. Copy to each host the allow-list, the secret of the task
    it runs, and nothing else; clients get the allow-list and the client secret. See SECURITY.md.
    """
    try:
        spec = resolve(cluster, None, env={}, require_task=False)[0] if cluster is not None else None
        allow = generate_keys(directory, spec, force=force)
    except ConfigError as exc:
        fail("keys", exc, EXIT_USAGE)
    except FileExistsError as exc:  # a key file left by an earlier run that did not finish
        fail("keys", f"cannot write {exc.filename}: it already exists (left by an earlier run?); pass --force "
                     f"to replace the keys in {directory}", EXIT_USAGE)
    except OSError as exc:  # a directory that cannot be made or written, a path through a file
        fail("keys", f"cannot write keys to {directory}: {exc.filename or directory}: {exc.strerror or exc}",
             EXIT_USAGE)
    tasks = ", ".join("every task (shared key)" if t == "*" else t for t in allow["tasks"])
    click.echo(f"wrote keys to {directory}: tasks {tasks}; clients {', '.join(allow['clients'])}")
    click.echo(f"  {directory}/{ALLOW_FILE}              public keys by role (copy to every host and client)")
    click.echo(f"  {directory}/tasks/<job>-<index>.key_secret   a task's secret (only to the host running it)")
    click.echo(f"  {directory}/clients/client.key_secret   the client secret (to clients only)")
    click.echo(f"start tasks with --keys {directory} (or ZMQFLOW_KEYS={directory})")
