"""``zmqflow bench``: throughput and latency benchmarks, each beside its baseline in the same run."""

from __future__ import annotations

import click

from .common import FiniteFloatRange

__all__ = ["bench"]


@click.group()
def bench() -> None:
    """Run a benchmark (each prints a table of ratios to its baseline)."""


@bench.command("transport")
@click.option("--quick", is_flag=True, help="Fewer sizes and iterations (under a minute).")
@click.option("--transport", "transports", multiple=True, type=click.Choice(["inproc", "ipc", "tcp"]), help="Repeatable; default all.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write JSON lines here (replacing the file).")
@click.option("--curve", is_flag=True, help="Also measure ipc and tcp with CurveZMQ on, beside off.")
@click.option("--keys", metavar="DIR", envvar="ZMQFLOW_KEYS", type=click.Path(file_okay=False),
              help="Key directory for the CURVE runs (a shared task key; implies --curve); default: temporary keys.")
def transport(quick: bool, transports: tuple[str, ...], json_out: str | None, curve: bool, keys: str | None) -> None:
    """Tensor throughput and round-trip latency: zmqflow vs raw pyzmq vs memcpy (and CURVE's cost)."""
    from ..bench.transport import run

    # run() reports as it goes and ends with the table itself
    run(quick=quick, transports=transports or ("inproc", "ipc", "tcp"), json_out=json_out, echo=click.echo,
        curve=curve, keys=keys)


@bench.command("ps")
@click.option("--quick", is_flag=True, help="A smaller model (20 MB; with --vs tf1 64 MB still) and fewer repetitions.")
@click.option("--shards", "shards", multiple=True, type=click.IntRange(1, 16),
              help="Repeatable; default 1, 2, 4 (1, 2 with --vs tf1).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
@click.option("--vs", "rival", type=click.Choice(["tf1"]),
              help="Do the same work on a rival in the same run: tf1 = TensorFlow gRPC ps tasks and a "
                   "tf.compat.v1 worker session (needs the [anchors] extra).")
@click.option("--model-mb", "model_mbs", multiple=True, type=FiniteFloatRange(min=0.1),
              help="Model size in MB; repeatable (several draw a curve with --plot). "
                   "Default 100 (20 with --quick); 64 with --vs tf1.")
@click.option("--vars", "variables", type=click.IntRange(1, 4000),
              help="With --vs tf1: the dense model as this many variables of one size (default 10).")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False),
              help="Draw throughput against model size into this image (needs the [plot] extra).")
def ps(quick: bool, shards: tuple[int, ...], json_out: str | None, rival: str | None, model_mbs: tuple[float, ...],
       variables: int | None, plot_out: str | None) -> None:
    """Pull/push of a whole model over 1-4 ps shards and scalar updates, vs raw pyzmq (or vs TF1 ps)."""
    from ..bench.anchors import plot

    if plot_out and not plot.available():
        raise click.ClickException(plot.MISSING)
    if rival == "tf1":
        from ..bench.anchors import tf1

        if not tf1.tf_available():  # an optional extra: say so before anything runs
            raise click.ClickException(tf1.MISSING_TF)
        rows = tf1.run(quick=quick, shards=shards or (1, 2), model_mbs=model_mbs or (64,), json_out=json_out,
                       echo=click.echo, **({} if variables is None else {"nvars": variables}))
        click.echo(tf1.format_table(rows))
        if plot_out:
            plot.plot_ps_vs_tf1(rows, plot_out)
            click.echo(f"plot: {plot_out}")
        return
    if variables is not None:
        raise click.UsageError("--vars goes with --vs tf1 (the raw-pyzmq side moves one model's bytes)")
    from ..bench.ps import format_table, run

    rows = []
    for mb in model_mbs or (None,):
        rows += run(quick=quick, shards=shards or (1, 2, 4), model_mb=mb, json_out=json_out, echo=click.echo)
    click.echo(format_table(rows))
    if plot_out:
        plot.plot_ps(rows, plot_out)
        click.echo(f"plot: {plot_out}")


@bench.command("step")
@click.option("--quick", is_flag=True, help="Fewer steps and rounds (seconds).")
@click.option("--kb", "sizes", metavar="LIST", help="Comma-separated model sizes in KB (default 4,16,48,256,1000).")
@click.option("--vars", "variables", type=click.IntRange(1, 4000), default=4, show_default=True,
              help="Variables in the model: 4 shaped as a small MLP's, else as many of one size.")
@click.option("--transport", type=click.Choice(["tcp", "ipc"]), default="tcp", show_default=True)
@click.option("--async", "is_async", is_flag=True, help="Plain SGD variables instead of SyncReplicas over one replica.")
@click.option("--optimizer", type=click.Choice(["sgd", "momentum", "adagrad", "adam"]), default="sgd",
              show_default=True, help="The variables' optimizer (its defaults, at rate 0.01).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def step_bench(quick: bool, sizes: str | None, variables: int, transport: str, is_async: bool, optimizer: str,
               json_out: str | None) -> None:
    """A small model's step on a ps shard: push then pull, beside push_pull (the rows in the push's answers)."""
    from ..bench.small_step import SIZES_KB, format_table, run

    try:
        kbs = [float(x) for x in sizes.split(",")] if sizes else list(SIZES_KB)
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {sizes!r}", param_hint="--kb") from None
    if any(not 0 < kb <= 1e6 for kb in kbs):
        raise click.BadParameter(f"sizes must be in (0, 1e6] KB, got {sizes!r}", param_hint="--kb")
    click.echo(format_table(run(kbs, sync=not is_async, quick=quick, transport=transport, json_out=json_out,
                                variables=variables, optimizer=optimizer)))


@bench.command("embedding")
@click.option("--quick", is_flag=True, help="A smaller table and fewer batches.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def embedding(quick: bool, json_out: str | None) -> None:
    """Sharded lookups/pushes of 4096 Zipf ids vs numpy take; memory of a 10M x 64 table."""
    from ..bench.embedding import format_table, run

    click.echo(format_table(run(quick=quick, json_out=json_out)))


@bench.command("tables")
@click.option("--quick", is_flag=True, help="Fewer steps.")
@click.option("--tables", type=click.IntRange(1, 512), default=8, show_default=True, help="Tables of the model.")
@click.option("--batch", type=click.IntRange(1, 1 << 20), default=512, show_default=True, help="Ids a table a step.")
@click.option("--shards", type=click.IntRange(1, 16), default=2, show_default=True, help="ps shard processes.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def tables_bench(quick: bool, tables: int, batch: int, shards: int, json_out: str | None) -> None:
    """A model's many tables: lookups and pushes table by table vs one request a shard."""
    from ..bench.embedding_tables import format_table, run

    click.echo(format_table(run(quick=quick, tables=tables, batch=batch, shards=shards, json_out=json_out)))


@bench.command("optim")
@click.option("--quick", is_flag=True, help="16 MB instead of 64, and fewer repetitions.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def optim_bench(quick: bool, dtype: str, json_out: str | None) -> None:
    """A shard's optimizer step: numpy's whole-array passes vs the one-pass C loops."""
    from ..bench.optim import format_table, run

    click.echo(format_table(run(quick=quick, dtype=dtype, json_out=json_out)))


@bench.command("fold")
@click.option("--quick", is_flag=True, help="A 16 MB result instead of 64, and fewer repetitions.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def fold_bench(quick: bool, dtype: str, json_out: str | None) -> None:
    """The shared-memory ring's sum, 2 and 3 ranks: numpy's pass per rank vs the one-pass C loop."""
    from ..bench.fold import format_table, run

    click.echo(format_table(run(quick=quick, dtype=dtype, json_out=json_out)))


@bench.command("allreduce")
@click.option("--quick", is_flag=True, help="Sizes up to 16 MB, fewer repetitions.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
@click.option("--vs", "rival", type=click.Choice(["gloo"]),
              help="Require the rival: gloo = torch.distributed's allreduce (needs the [torch] extra). "
                   "Without it gloo runs only when torch is installed.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False),
              help="Draw bus bandwidth against size into this image (needs the [plot] extra).")
@click.option("--ranks", "ranks", type=click.IntRange(2, 16), multiple=True, metavar="N",
              help="Ranks of one run (repeatable; 2 and 3 when none is given).")
@click.option("--sizes", "sizes", metavar="LIST", help="Comma-separated sizes in bytes instead of the defaults, "
              "e.g. 64K,1M,16M,64M (float32: multiples of 4).")
@click.option("--no-ps", "no_ps", is_flag=True, help="Leave out the PS push/pull columns.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the buffers live: cuda reduces cupy arrays (the ring) and CUDA tensors (gloo) on the GPU.")
def allreduce(quick: bool, json_out: str | None, rival: str | None, plot_out: str | None, ranks: tuple[int, ...],
              sizes: str | None, no_ps: bool, device: str) -> None:
    """Ring allreduce vs gloo (when torch is installed) vs memcpy vs PS push/pull."""
    from ..bench.allreduce import format_table, gloo_available, run
    from ..bench.anchors import plot
    from ..errors import ConfigError
    from ..bench.transport.plan import parse_sizes

    if plot_out and not plot.available():
        raise click.ClickException(plot.MISSING)
    if rival == "gloo" and not gloo_available():
        raise click.ClickException("zmqflow bench allreduce --vs gloo needs PyTorch: pip install 'zmqflow[torch]'")
    try:
        chosen = parse_sizes(sizes) if sizes is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sizes") from None
    if chosen is not None and not chosen:
        raise click.BadParameter("no size given", param_hint="--sizes")
    try:
        rows = run(quick=quick, json_out=json_out, echo=click.echo, gloo=True if rival == "gloo" else None,
                   ranks=ranks or (2, 3), sizes=chosen, ps=not no_ps, device=device)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(format_table(rows))
    if plot_out:
        plot.plot_allreduce(rows, plot_out)
        click.echo(f"plot: {plot_out}")


@bench.command("recovery")
@click.option("--quick", is_flag=True, help="One run per case instead of five.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def recovery(quick: bool, json_out: str | None) -> None:
    """How long sync training stops when a ps shard is killed, beside a bare process restart."""
    from ..bench.recovery import format_table, run

    click.echo(format_table(run(quick=quick, json_out=json_out)))


@bench.command("torch")
@click.option("--quick", is_flag=True, help="Fewer steps and a smaller table.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
@click.option("--only", type=click.Choice(["ddp", "embedding"]), help="Run one of the two parts.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the DDP part's models and gradients live.")
def torch_bench(quick: bool, json_out: str | None, only: str | None, device: str) -> None:
    """DistributedOptimizer vs torch DDP over gloo (2 ranks); EmbeddingBag vs torch's (needs [torch])."""
    try:
        import torch  # noqa: F401  (an optional extra: say so plainly when it is missing)
    except ImportError:
        raise click.ClickException("zmqflow bench torch needs PyTorch: pip install 'zmqflow[torch]'") from None
    if only in (None, "ddp"):
        from ..bench import torch_ddp

        from ..errors import ConfigError

        try:
            click.echo(torch_ddp.format_table(torch_ddp.run(quick=quick, json_out=json_out, device=device)))
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
    if only in (None, "embedding"):
        from ..bench import torch_embedding

        click.echo(torch_embedding.format_table(torch_embedding.run(quick=quick, json_out=json_out)))


@bench.command("cluster")
@click.option("--netns", is_flag=True, help="Each task on its own simulated host: a network namespace with a "
              "rate-limited link to one bridge (needs root and `ip netns`). Without it: loopback, no limit.")
@click.option("--quick", is_flag=True, help="An 8 MB model, ps 1 and 4, shorter runs (about a minute).")
@click.option("--rate", "rates", multiple=True, type=FiniteFloatRange(min=0.001), metavar="GBIT",
              help="Link rate in Gbit/s, each way; repeatable; default 1 and 10.")
@click.option("--ps", "ps", multiple=True, type=click.IntRange(1, 16), help="ps task counts; repeatable; default 1, 2, 4.")
@click.option("--workers", "workers", multiple=True, type=click.IntRange(1, 16), help="Worker counts; repeatable; default 2, 4.")
@click.option("--model-mb", type=FiniteFloatRange(min=0.001), help="Model size in MB (default 32; 8 with --quick).")
@click.option("--step", "steps", multiple=True, type=click.Choice(["pull-push", "push-pull"]),
              help="A worker's round: pull then push, or Session.push_pull (both at once); repeatable; default both.")
@click.option("--seconds", type=FiniteFloatRange(min=0.1), help="Measured seconds per row (default 4; 2 with --quick).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
@click.option("--cleanup", is_flag=True, help="Remove the namespaces (and their processes) any run left behind, then exit.")
@click.option("--ip", "ip", default="ip", show_default=True, metavar="PATH", help="iproute2's ip.")
@click.option("--tc", "tc", default="tc", show_default=True, metavar="PATH", help="iproute2's tc.")
def cluster(netns: bool, quick: bool, rates: tuple[float, ...], ps: tuple[int, ...], workers: tuple[int, ...],
            steps: tuple[str, ...], model_mb: float | None, seconds: float | None, json_out: str | None, cleanup: bool,
            ip: str, tc: str) -> None:
    """PS throughput as ps tasks go 1 -> 4 and workers 2 -> 4, each task its own host on a limited link."""
    from ..bench.netns.net import check_netns
    from ..bench.netns.net import cleanup as sweep
    from ..bench.netns.run import format_table, run
    from ..errors import ZmqflowError

    try:
        if cleanup:
            check_netns(ip, tc)
            removed = sweep(ip=ip)
            click.echo(f"removed {len(removed)} namespace(s){': ' + ' '.join(removed) if removed else ''}")
            return
        rows = run(quick=quick, netns=netns, rates=rates, ps=ps, workers=workers, model_mb=model_mb,
                   seconds=seconds, json_out=json_out, echo=click.echo, ip=ip, tc=tc, steps=steps)
    except (ZmqflowError, RuntimeError) as exc:  # RuntimeError: a task process failed, its log in the message
        raise click.ClickException(f"bench cluster: {exc}") from None
    click.echo(format_table(rows))
