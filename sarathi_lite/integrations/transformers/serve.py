"""``transformers serve`` with sarathi-lite's scheduler::

    python -m sarathi_lite.integrations.transformers.serve MODEL --continuous-batching \\
        --sarathi '{"chunk_size": 256}' [any other option of transformers serve]

transformers' own command cannot pick a scheduler: it builds its ``ContinuousBatchingConfig`` from five ``--cb-*``
flags, none of them ``scheduler_type``, and loads the model in a spawned process that imports nothing of ours. This
launcher is transformers' ``Serve`` command with one more option, ``--sarathi`` (a JSON object of the options
``register`` takes): it registers the scheduler, sets ``scheduler_type`` on the config the server hands its model
process, and the name it sets (a ``SchedulerName``) registers the same scheduler in that process as it is
unpickled there. Everything else is transformers' server.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import typer
from transformers import ContinuousBatchingConfig
from transformers.cli.serve import Serve

from .scheduler import SchedulerName, register

OPTION = "--sarathi"


class SarathiServe(Serve):
    """transformers' ``Serve`` whose continuous batching runs ``scheduler_name`` (set by ``main``)."""

    scheduler_name: ClassVar[SchedulerName | None] = None

    def _use_scheduler(self) -> None:
        if self.scheduler_name is None:  # an API server's spawned process: its pickled config has the name already
            return
        state = self.generation_state
        if state.cb_config is None:
            state.cb_config = ContinuousBatchingConfig()
        state.cb_config.scheduler_type = self.scheduler_name

    def run(self, *args: Any, **kwargs: Any) -> None:
        self._use_scheduler()
        super().run(*args, **kwargs)

    def run_api_servers(self, *args: Any, **kwargs: Any) -> None:
        self._use_scheduler()
        super().run_api_servers(*args, **kwargs)


def split_options(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``(the --sarathi options, the other arguments)`` of a command line. Raises ``ValueError`` naming a
    ``--sarathi`` value that is not a JSON object, and a command line without ``--continuous-batching`` (the
    scheduler runs only inside continuous batching)."""
    rest, options = [], {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == OPTION or arg.startswith(OPTION + "="):
            text = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            try:
                options = json.loads(text)
            except json.JSONDecodeError:
                options = None
            if not isinstance(options, dict):
                raise ValueError(f"{OPTION} takes a JSON object of sarathi-lite options, not {text!r}")
        else:
            rest.append(arg)
    if "--continuous-batching" not in rest and "--help" not in rest:
        raise ValueError("sarathi-lite schedules transformers' continuous batching: add --continuous-batching")
    return options, rest


def main(argv: Sequence[str] | None = None) -> None:
    """Run the launcher on ``argv`` (default: the command line)."""
    try:
        options, rest = split_options(sys.argv[1:] if argv is None else argv)
        SarathiServe.scheduler_name = register("sarathi", **options)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    app = typer.Typer(add_completion=False)
    app.command(name="serve", help=Serve.__doc__)(SarathiServe)
    app(rest, prog_name="python -m sarathi_lite.integrations.transformers.serve")


if __name__ == "__main__":
    main()
