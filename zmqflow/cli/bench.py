"""``zmqflow bench``: throughput and latency benchmarks, each beside its baseline in the same run."""

from __future__ import annotations

import click

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
@click.option("--quick", is_flag=True, help="A 20 MB model and fewer repetitions.")
@click.option("--shards", "shards", multiple=True, type=click.IntRange(1, 16), help="Repeatable; default 1, 2, 4.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def ps(quick: bool, shards: tuple[int, ...], json_out: str | None) -> None:
    """Pull/push of a whole model over 1-4 ps shards and scalar updates, vs raw pyzmq."""
    from ..bench.ps import format_table, run

    click.echo(format_table(run(quick=quick, shards=shards or (1, 2, 4), json_out=json_out)))


@bench.command("embedding")
@click.option("--quick", is_flag=True, help="A smaller table and fewer batches.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def embedding(quick: bool, json_out: str | None) -> None:
    """Sharded lookups/pushes of 4096 Zipf ids vs numpy take; memory of a 10M x 64 table."""
    from ..bench.embedding import format_table, run

    click.echo(format_table(run(quick=quick, json_out=json_out)))


@bench.command("allreduce")
@click.option("--quick", is_flag=True, help="Sizes up to 16 MB, fewer repetitions.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Append JSON lines here.")
def allreduce(quick: bool, json_out: str | None) -> None:
    """Ring allreduce vs gloo (when torch is installed) vs memcpy vs PS push/pull."""
    from ..bench.allreduce import format_table, run

    click.echo(format_table(run(quick=quick, json_out=json_out)))


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
def torch_bench(quick: bool, json_out: str | None, only: str | None) -> None:
    """DistributedOptimizer vs torch DDP over gloo (2 ranks); EmbeddingBag vs torch's (needs [torch])."""
    try:
        import torch  # noqa: F401  (an optional extra: say so plainly when it is missing)
    except ImportError:
        raise click.ClickException("zmqflow bench torch needs PyTorch: pip install 'zmqflow[torch]'") from None
    if only in (None, "ddp"):
        from ..bench import torch_ddp

        click.echo(torch_ddp.format_table(torch_ddp.run(quick=quick, json_out=json_out)))
    if only in (None, "embedding"):
        from ..bench import torch_embedding

        click.echo(torch_embedding.format_table(torch_embedding.run(quick=quick, json_out=json_out)))
