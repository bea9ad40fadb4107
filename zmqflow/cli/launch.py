"""``zmqflow launch``: a whole cluster as local processes, each line of output tagged with its task.

Without a command every task runs ``zmqflow serve``. With one, ps (and other non-training) tasks
serve while chief, worker and evaluator tasks run the command with ``ZMQFLOW_CLUSTER`` and
``ZMQFLOW_TASK`` set; when the commands end the servers are stopped, and the exit code is the
first failure's. An evaluator (``--evaluator``, or an ``evaluator`` job in the cluster) runs the
command beside training and does not decide the exit code (:mod:`zmqflow.cli.launch_roles`); ps
tasks exit by themselves once training is over (:mod:`zmqflow.cli.launch_exit`).

``--keys DIR`` hands every process ``ZMQFLOW_KEYS``: servers admit only listed keys, and training
scripts (tasks themselves) present their task keys. Without keys, a cluster beyond loopback needs
``--insecure`` (passed on as ``ZMQFLOW_INSECURE=1``).

torch.distributed beside it: every process that runs the command as a rank (the chief, then the
workers by index, as :func:`zmqflow.client.ring.default_members` orders them) also gets ``RANK``,
``WORLD_SIZE`` (the number of ranks), ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (counted over the
ranks whose address names the same host), ``MASTER_ADDR`` (rank 0's host) and ``MASTER_PORT`` (a
port free on that host, chosen once per launch), so ``torch.distributed.init_process_group("gloo",
init_method="env://")`` works in the script unchanged. A restarted task keeps its rank and the same
``MASTER_*``. Tasks that are not ranks (ps, evaluator, any other job) get ``MASTER_ADDR`` and
``MASTER_PORT`` only: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are removed
from their environment, even when launch's own environment had them (launch under torchrun).

Checkpoint roots: ``--checkpoint-root DIR`` confines every task's checkpoint writes (passed as
``ZMQFLOW_CHECKPOINT_ROOTS``). Without it, on a cluster whose every address is loopback (one
user's processes on one machine), launch sets ``ZMQFLOW_CHECKPOINT_ROOTS=*`` (anywhere) so a
script's ``checkpoint_dir`` works wherever it points, as it always did; it says so on start. A
cluster reachable from other hosts gets no such default: give ``--checkpoint-root``.

Output: each line once, tagged ``[job:index]`` (``zmqflow serve`` under launch leaves the tag out
of its log format, told by ``ZMQFLOW_OUTPUT_TAGGED``); ``--log-dir DIR`` also appends each task's
lines, untagged, to ``DIR/job-index.log`` with a marker line per start and exit. A task that
fails (and is not brought back) is summarised at the end: its exit code or signal and last lines.
Restarted processes see ``ZMQFLOW_RESTART_COUNT`` (0 on the first start). Ctrl-C is passed to
every task's process group; launch exits 130 once none is left.

Process groups (:mod:`zmqflow.cli.launch_groups`): when a task's process exits, whatever it left
in its process group is ended (SIGTERM, then SIGKILL) before the task is restarted or reported,
so a restart finds its port free; launch's stop ends every group it started. On Linux a task also
gets SIGTERM if launch itself is killed outright.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import click

from ..client.ring import default_members
from ..cluster import ClusterSpec, TaskId
from ..errors import ConfigError
from ..server.checkpoint_roots import ENV as ROOTS_ENV
from ..server.checkpoint_roots import CheckpointRoots
from ..transport.curve import KEYS_ENV, Keys, is_loopback
from .cluster_arg import load_cluster_arg
from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, LOG_LEVELS, TAGGED_ENV, FiniteFloatRange, fail
from .launch_exit import exit_env, let_finish
from .launch_groups import ProcessGroups, die_with
from .launch_output import TaskOutput, describe_exit
from .launch_roles import EVALUATOR_GRACE, await_side_tasks, is_side_task, with_evaluator

__all__ = ["launch", "Launcher", "generate_cluster", "launch_roots", "rank_env", "RANK_VARS", "RESTART_ENV",
           "load_cluster_arg", "EXIT_INTERRUPTED"]

COMMAND_JOBS = ("chief", "worker", "evaluator", "master")
STOP_GRACE = 5.0
EXIT_DRAIN_S = 1.0  # after a task's process exits, how long its last output may take to be printed
# What torch.distributed's env:// reads; only ranks get the first four.
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# How many times launch restarted this task before this process (0 on the first start).
RESTART_ENV = "ZMQFLOW_RESTART_COUNT"
EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for Ctrl-C


def _host(spec: ClusterSpec, task: TaskId) -> str:
    """The host a task's address names: loopback for ipc/inproc and wildcard binds."""
    host = spec.address(task).host
    return "127.0.0.1" if host in ("", "*", "0.0.0.0") else "::1" if host == "::" else host


def master_endpoint(spec: ClusterSpec) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT): rank 0's host (the chief, else worker 0, else the first task)
    and a port free there now. Chosen once per launch, so restarted ranks meet at the same one."""
    from ..ports import free_port

    ranks = default_members(spec)
    host = _host(spec, ranks[0] if ranks else spec.tasks[0])
    try:
        port = free_port(host)
    except OSError:  # a name this machine cannot bind (the cluster file names another host)
        port = free_port()
    return host, port


def rank_env(spec: ClusterSpec, task: TaskId, master: tuple[str, int]) -> dict[str, str | None]:
    """The torch.distributed variables for ``task``: a value to set, or None to remove.

    Ranks are the chief then the workers by index; LOCAL_* count the ranks on ``task``'s host.
    Any other task gets MASTER_ADDR/MASTER_PORT and has the rank variables removed."""
    out: dict[str, str | None] = {"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
    ranks = default_members(spec)
    if task not in ranks:
        out.update(dict.fromkeys(RANK_VARS))
        return out
    host = _host(spec, task)
    local = [r for r in ranks if _host(spec, r) == host]
    out.update(RANK=str(ranks.index(task)), WORLD_SIZE=str(len(ranks)), LOCAL_RANK=str(local.index(task)),
               LOCAL_WORLD_SIZE=str(len(local)))
    return out


def generate_cluster(workers: int, ps: int, chief: bool, host: str = "127.0.0.1") -> ClusterSpec:
    """A cluster on free loopback ports: ``chief`` (optional), ``worker`` and ``ps`` jobs."""
    from ..ports import free_port

    jobs: dict[str, list[str]] = {}
    if chief:
        jobs["chief"] = [f"{host}:{free_port(host)}"]
    if workers:
        jobs["worker"] = [f"{host}:{free_port(host)}" for _ in range(workers)]
    if ps:
        jobs["ps"] = [f"{host}:{free_port(host)}" for _ in range(ps)]
    return ClusterSpec(jobs)


def _loopback_only(spec: ClusterSpec) -> bool:
    """Whether no task of ``spec`` listens beyond this machine (the protected mode's own test)."""
    return all(is_loopback(spec.address(t).bind_endpoint()) for t in spec.tasks)


def launch_roots(spec: ClusterSpec, given: list[str], environ: "dict[str, str] | os._Environ[str]") -> CheckpointRoots:
    """Where launched tasks may write checkpoints: ``given`` roots; else the caller's own
    ``ZMQFLOW_CHECKPOINT_ROOTS``; else anywhere on a loopback cluster, nowhere on any other."""
    if given:
        return CheckpointRoots.parse(given)
    if ROOTS_ENV in environ:
        return CheckpointRoots.parse(None, environ)
    return CheckpointRoots(anywhere=_loopback_only(spec))


@dataclass(eq=False)
class _Child:
    task: TaskId
    argv: list[str]
    runs_command: bool
    proc: subprocess.Popen | None = None
    restarts: int = 0
    failure: int | None = None  # the returncode of its final, failed run
    pump: threading.Thread | None = field(default=None, repr=False)


class Launcher:
    """Starts, watches and stops the processes of one local cluster."""

    def __init__(self, spec: ClusterSpec, command: list[str], *, log_level: str = "info", out=None,
                 restart: str = "never", max_restarts: int = 3, keys: str | None = None, insecure: bool = False,
                 checkpoint_roots: CheckpointRoots | None = None, log_dir: str | None = None,
                 evaluator_grace: float = EVALUATOR_GRACE, ps_exit_when_done: bool = True):
        self.spec = spec
        self.evaluator_grace = evaluator_grace
        self.keys = keys
        self.insecure = insecure
        self.checkpoint_roots = checkpoint_roots or launch_roots(spec, [], os.environ)
        self.restart = restart
        self.ps_exit_when_done = ps_exit_when_done and bool(command)  # see launch_exit.py
        self.max_restarts = max_restarts
        self.command = command
        self.log_level = log_level
        self.output = TaskOutput(out or sys.stdout, log_dir)
        self._events: list[tuple[str, _Child]] = []
        self._cond = threading.Condition(self.output.lock)
        self._first_failure: int | None = None
        self._stopping = False
        self._signalled = False
        self._interrupt: int | None = None  # the signal launch itself received, if any
        self._interrupted_at = 0.0
        self._announced = False
        self._groups = ProcessGroups()  # every task's group that may still hold processes
        self.master = master_endpoint(spec)
        self.children = [self._child(t) for t in spec.tasks]

    def _child(self, task: TaskId) -> _Child:
        runs = bool(self.command) and task.job in COMMAND_JOBS
        argv = list(self.command) if runs else [sys.executable, "-m", "zmqflow", "serve", "--log-level", self.log_level]
        return _Child(task, argv, runs)

    def env_for(self, task: TaskId, restarts: int = 0) -> dict[str, str]:
        """The environment of the process that runs ``task``: the same for each of its restarts
        but ``ZMQFLOW_RESTART_COUNT``."""
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        env.update(ZMQFLOW_CLUSTER=self.spec.to_json(), ZMQFLOW_TASK=str(task), PYTHONUNBUFFERED="1")
        env[RESTART_ENV] = str(restarts)
        env[TAGGED_ENV] = "1"  # launch prefixes each line with the task: logging need not
        if self.keys is not None:
            env[KEYS_ENV] = os.path.abspath(self.keys)
        if self.insecure:
            env["ZMQFLOW_INSECURE"] = "1"
        env[ROOTS_ENV] = self.checkpoint_roots.to_env()
        env.update(exit_env(task, not (self.command and task.job in COMMAND_JOBS), self.ps_exit_when_done))
        for key, value in rank_env(self.spec, task, self.master).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def say(self, line: str, tag: str = "launch") -> None:
        self.output.say(line, tag)

    def start(self) -> None:
        """Start every task. Call :meth:`start` and :meth:`wait` from one thread that outlives the
        tasks (the main thread under ``zmqflow launch``): see :meth:`_start`."""
        self.say(f"cluster {self.spec.to_json()}")
        roots = self.checkpoint_roots
        hint = " (--checkpoint-root DIR confines them)" if roots.anywhere else \
            "" if roots.roots else ": checkpoint saves are refused (give --checkpoint-root DIR)"
        self.say(f"checkpoint roots: {roots.describe()}{hint}")
        for child in self.children:
            self._start(child)

    def _start(self, child: _Child) -> None:
        if self._signalled:  # interrupted while starting: start no more
            return
        # Each child gets its own session so a terminal's Ctrl-C reaches it once, through us.
        # Children, restarts included, are started only here, from the thread that runs start() and
        # wait() (never a waiter thread, which ends before the task does): the parent-death signal
        # fires when the forking thread ends, so it must be the one that lives as long as launch.
        child.proc = subprocess.Popen(
            child.argv,
            env=self.env_for(child.task, child.restarts),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with(os.getpid()),
        )
        self._groups.add(child.proc.pid)  # its own session: the group id is its pid
        self.output.started(child.task, child.proc.pid, child.restarts)
        child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.pump.start()
        threading.Thread(target=self._waiter, args=(child, child.proc, child.pump), daemon=True).start()

    def _pump(self, child: _Child) -> None:
        assert child.proc is not None and child.proc.stdout is not None
        for raw in child.proc.stdout:
            self.output.line(child.task, raw.decode(errors="replace").rstrip("\n"))

    def _waiter(self, child: _Child, proc: subprocess.Popen, pump: threading.Thread) -> None:
        """The process's end, reported when it exits: not when its output ends, which a process it
        started and left running (holding the pipe) can put off for good. Its last lines first.
        What it left in its group is ended first (here, not on launch's loop, which the grace would
        hold up): a helper holding the task's port would make every restart fail."""
        code = proc.wait()
        self._groups.end(proc.pid)
        pump.join(EXIT_DRAIN_S)
        self.output.ended(child.task, code)
        if code != 0 and not (self._stopping and not child.runs_command):
            self.say(f"{child.task} exited with {describe_exit(code)}")
        with self._cond:
            self._events.append(("exit", child))
            self._cond.notify_all()

    def signal_all(self, sig: int) -> set[int]:
        """``sig`` to every running task's process group (its own children too); the groups sent it."""
        self._signalled = True  # tasks ending now were asked to: never restart them
        sent: set[int] = set()
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                try:
                    os.killpg(child.proc.pid, sig)  # its own session: the group id is its pid
                    sent.add(child.proc.pid)
                except (ProcessLookupError, PermissionError):
                    pass
        return sent

    def interrupt(self, sig: int) -> None:
        """Launch got ``sig`` (Ctrl-C, SIGTERM): pass it on. Safe in a signal handler: it writes
        nothing and takes no lock; :meth:`wait` reports it and stops whatever lingers."""
        if self._interrupt is None:
            self._interrupt = sig
            self._interrupted_at = time.monotonic()
        self.signal_all(sig)

    def wait(self) -> int:
        """Until the commands end (or, without one, any task ends); then stop the rest, whatever
        goes wrong meanwhile (a restart that cannot start, output that cannot be written)."""
        try:
            return self._wait()
        except BaseException:
            self.stop()
            raise

    def _wait(self) -> int:
        # an evaluator's command is not waited for here, and its exit code is not launch's (launch_roles)
        pending = {c for c in self.children if (c.runs_command and not is_side_task(c.task) if self.command else True)
                   and c.proc is not None}
        while pending:
            with self._cond:
                self._announce()  # before any event: the tasks a passed-on signal ended report at once
                while not self._events:
                    self._announce()
                    if self._interrupt is not None and time.monotonic() - self._interrupted_at > STOP_GRACE:
                        break
                    self._cond.wait(0.2)
                if not self._events:  # interrupted, and some task has not ended: stop() ends it
                    break
                kind, child = self._events.pop(0)
            returncode = child.proc.returncode if child.proc else 1
            code = _exit_code(returncode)
            if code != 0 and self._should_restart(child):
                child.restarts += 1
                self.say(f"restarting {child.task} on {self.spec.address(child.task)} "
                         f"(restart {child.restarts} of {self.max_restarts})")
                self._start(child)
                continue
            if code != 0 and not self._stopping:
                if self._interrupt is None:  # a task that a passed-on signal ended did not fail
                    child.failure = returncode
                if self._first_failure is None and not (self.command and is_side_task(child.task)):
                    self._first_failure = code
            pending.discard(child)
            if not self.command or (code != 0 and not child.runs_command):
                break  # a server ended on its own: nothing left to wait for
        if self.command and self._first_failure is None and self._interrupt is None:
            await_side_tasks([(c.task, c.proc) for c in self.children if is_side_task(c.task) and c.proc is not None],
                             self.evaluator_grace, self.say)
        self._announce()
        if self.ps_exit_when_done and self._first_failure is None and self._interrupt is None:
            let_finish({c.task: c.proc for c in self.children if not c.runs_command and c.proc}, self.spec, self.keys)
        self.stop()
        self.output.summary([(c.task, c.failure, c.restarts) for c in self.children if c.failure is not None])
        self.output.close()
        if self._interrupt == signal.SIGINT:
            return EXIT_INTERRUPTED
        if self._interrupt is not None and self.command:  # a stopped run is no success (a server's stop is)
            return self._first_failure or 128 + int(self._interrupt)
        return self._first_failure or EXIT_OK

    def _announce(self) -> None:
        """Say once that launch got a signal and passed it on (the handler itself writes nothing)."""
        if self._interrupt is not None and not self._announced:
            self._announced = True
            self.say(f"got {signal.Signals(self._interrupt).name}: passed it to every task")

    def _should_restart(self, child: _Child) -> bool:
        return (self.restart == "on-failure" and not self._stopping and not self._signalled
                and child.restarts < self.max_restarts)

    def stop(self) -> None:
        """SIGTERM to whatever still runs, SIGKILL after a grace period: every task and every group
        launch started, earlier runs' included (a waiter may still be ending one)."""
        self._stopping = True
        running = self.signal_all(signal.SIGTERM)
        self._groups.signal(signal.SIGTERM, skip=running)  # groups whose task's process already exited
        deadline = time.monotonic() + STOP_GRACE
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{child.task} did not stop within {STOP_GRACE:g}s; killing it")
                child.proc.kill()
                child.proc.wait()
        self._groups.kill_left(deadline)  # whatever the tasks started and left behind in their groups
        for child in self.children:
            if child.pump is not None:
                child.pump.join(2.0)


def check_keys(spec: ClusterSpec, keys: str | None, insecure: bool) -> None:
    """Before any process starts: every task has its key, or (no keys) the cluster stays on loopback."""
    if keys is not None:
        for task in spec.tasks:
            Keys.load(keys, str(task), require_task=True)
        return
    exposed = [str(t) for t in spec.tasks if not is_loopback(spec.address(t).bind_endpoint())]
    if exposed and not insecure:
        raise ConfigError(f"tasks {', '.join(exposed)} would listen beyond loopback without keys: make keys with "
                          "`zmqflow keys generate DIR --cluster c.json` and pass --keys DIR, or pass --insecure")


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--cluster", metavar="PATH|JSON", help="Cluster spec to start (else generated from --workers/--ps).")
@click.option("--workers", type=click.IntRange(0, 256), default=None, help="Workers to generate on loopback ports.")
@click.option("--ps", type=click.IntRange(0, 256), default=None, help="Parameter-server tasks to generate.")
@click.option("--chief/--no-chief", default=False, help="Also generate a chief task.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Host for generated addresses.")
@click.option("--cluster-out", type=click.Path(dir_okay=False), help="Write the cluster spec here (for zmqflow status).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.option("--restart", type=click.Choice(["never", "on-failure"]), default="never", show_default=True,
              help="Restart a task whose process dies, on the same address.")
@click.option("--max-restarts", type=click.IntRange(0, 1000), default=3, show_default=True, help="Per task.")
@click.option("--keys", metavar="DIR", envvar=KEYS_ENV, type=click.Path(file_okay=False),
              help="CurveZMQ key directory for every task (zmqflow keys generate; else ZMQFLOW_KEYS).")
@click.option("--insecure", is_flag=True, help="Without keys, let tasks serve non-loopback addresses anyway.")
@click.option("--checkpoint-root", "checkpoint_roots", multiple=True, metavar="DIR",
              help="Confine every task's checkpoint writes under DIR; repeatable. Default: anywhere on a "
                   "loopback cluster, nowhere on one other hosts can reach.")
@click.option("--log-dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Also write each task's output to DIR/JOB-INDEX.log (appended across restarts).")
@click.option("--evaluator", is_flag=True, help="Add an evaluator:0 task running COMMAND beside training "
              "(zmqflow.train_and_evaluate evaluates each checkpoint there); launch's exit code stays the training tasks'.")
@click.option("--evaluator-grace", type=FiniteFloatRange(0), default=EVALUATOR_GRACE, show_default=True,
              metavar="SECONDS", help="After training ends, how long the evaluator may take to finish before it is stopped.")
@click.option("--ps-exit-when-done/--no-ps-exit-when-done", default=True, show_default=True,
              help="With a command, ps tasks exit by themselves once every chief and worker finished training.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def launch(cluster, workers, ps, chief, host, cluster_out, log_level, restart, max_restarts, keys, insecure,
           checkpoint_roots, log_dir, evaluator, evaluator_grace, ps_exit_when_done, command) -> None:
    """Start a cluster's tasks as local processes, optionally running COMMAND on chief and workers.

    \b
    Each process gets ZMQFLOW_CLUSTER and ZMQFLOW_TASK. For torch.distributed (init_method="env://"),
    ranks (the chief, then workers by index) also get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
    (over ranks on the same host), MASTER_ADDR (rank 0's host) and MASTER_PORT (free, chosen once per
    launch; a restarted task keeps its rank). ps, evaluator and other tasks get MASTER_ADDR and
    MASTER_PORT only, with RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE removed. A restarted
    process gets ZMQFLOW_RESTART_COUNT (0 on the first start).

    \b
    When a task fails, launch ends with a summary: each failed task, its exit code or signal and
    its last lines. Ctrl-C is passed to every task; launch then exits 130 with none left running."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        if cluster is not None:
            if workers is not None or ps is not None or chief:
                raise ConfigError("give either --cluster or --workers/--ps/--chief, not both")
            spec = load_cluster_arg(cluster)
        else:
            spec = generate_cluster(2 if workers is None else workers, 0 if ps is None else ps, chief, host)
        if evaluator:
            spec = with_evaluator(spec, host)
        if command and not any(t.job in COMMAND_JOBS and not is_side_task(t) for t in spec.tasks):
            raise ConfigError("COMMAND runs on chief, master and worker tasks: the cluster has none "
                              f"({spec.to_json()})")
        check_keys(spec, keys, insecure)
        roots = launch_roots(spec, list(checkpoint_roots), os.environ)
    except ConfigError as exc:
        fail("launch", exc, EXIT_USAGE)
    except OSError as exc:  # no free port on --host: not an address of this machine
        fail("launch", f"--host {host!r}: {exc.strerror or exc}", EXIT_USAGE)
    if cluster_out:
        try:
            with open(cluster_out, "w") as fh:
                fh.write(spec.to_json() + "\n")
        except OSError as exc:
            fail("launch", f"--cluster-out {cluster_out!r}: {exc.strerror or exc}", EXIT_USAGE)
    try:
        launcher = Launcher(spec, command, log_level=log_level, restart=restart, max_restarts=max_restarts,
                            keys=keys, insecure=insecure, checkpoint_roots=roots, log_dir=log_dir,
                            evaluator_grace=evaluator_grace, ps_exit_when_done=ps_exit_when_done)
    except OSError as exc:
        fail("launch", f"--log-dir {log_dir!r}: {exc.strerror or exc}", EXIT_USAGE)

    def forward(sig: int, _frame: object) -> None:
        launcher.interrupt(sig)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a closed terminal too: tasks have own sessions
        signal.signal(sig, forward)
    try:
        launcher.start()
    except OSError as exc:
        launcher.stop()
        fail("launch", f"cannot start {exc.filename or 'a task'}: {exc.strerror or exc}", EXIT_FAILURE)
    raise SystemExit(launcher.wait())
