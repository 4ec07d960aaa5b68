"""The ``rlflow`` command line."""

from __future__ import annotations

import typer

app = typer.Typer(help="RL post-training of language models as Prefect flows over Ray worker groups.",
                  no_args_is_help=True)


@app.callback()
def main() -> None:
    """rlflow: run, resume and inspect RL post-training runs."""


@app.command()
def demo() -> None:
    """Run the built-in demo on this machine."""
    from flows.demo import main

    main()


if __name__ == "__main__":
    app()
