"""The `specrt` command line: one module per command group (export, run, bench, serve, distill), each a thin layer
over the package that does the work; errors become one line on stderr and exit 1."""
from __future__ import annotations

import sys

import click

from specrt.errors import SpecrtError
from specrt.runtime.backends import own_process_defaults


class _Group(click.Group):
    """Turns SpecrtError (and friends) into one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecrtError as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"specrt: error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("specrt: interrupted", err=True)
            sys.exit(130)



@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(package_name="specrt")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Export LLMs with draft heads into fixed-shape graphs and run them with lossless speculative decoding."""
    ctx.obj = {"debug": debug}
    own_process_defaults()  # the command's process is specrt's: one ONNX Runtime thread pool (runtime/backends/ort.py)


from specrt.cli.export import build, export, fetch_model, inspect  # noqa: E402  (after main: they register on it)
from specrt.cli.run import demo, parity, run  # noqa: E402  (after main: they register on it)
from specrt.cli.bench import bench, compare, profile  # noqa: E402  (after main: they register on it)
from specrt.cli.serve import loadtest, serve, triton  # noqa: E402  (after main: they register on it)
from specrt.cli.distill import distill  # noqa: E402  (after main: they register on it)
from specrt.cli.doctor import doctor  # noqa: E402  (after main: they register on it)

main.add_command(export)
main.add_command(build)
main.add_command(inspect)
main.add_command(fetch_model)
main.add_command(run)
main.add_command(demo)
main.add_command(parity)
main.add_command(bench)
main.add_command(profile)
main.add_command(compare)
main.add_command(serve)
main.add_command(loadtest)
main.add_command(triton)
main.add_command(distill)
main.add_command(doctor)
