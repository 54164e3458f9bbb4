"""The command line's own surface, without a database: --version, and every command
group run without its sub-command (the usage on stderr, then one line naming the
choices, exit 2; never a help page followed by an empty error)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import typer

from outbox_relay import __version__
from outbox_relay.operator.cli import app
from tests.helpers.cli import cli, cli_env

pytestmark = pytest.mark.first_pass_only


def _groups(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], list[str]]]:
    """Every group of the typer app (the root too), with its visible sub-commands."""
    if not hasattr(command, "list_commands"):
        return []
    ctx = typer.Context(command)
    names = [n for n in command.list_commands(ctx) if not command.get_command(ctx, n).hidden]
    found = [(path, names)]
    for name in names:
        found += _groups(command.get_command(ctx, name), (*path, name))
    return found


def test_version_prints_the_name_and_the_version():
    result = cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"outbox-relay {__version__}\n"
    assert result.stderr == ""


GROUPS = _groups(typer.main.get_command(app))


def test_the_app_has_command_groups():
    assert {path for path, _ in GROUPS} >= {(), ("dead",), ("aggregate",), ("audit",)}


@pytest.mark.parametrize(("path", "choices"), GROUPS, ids=[" ".join(p) or "outbox-relay" for p, _ in GROUPS])
def test_a_group_without_its_subcommand_names_the_choices(path: tuple[str, ...], choices: list[str]):
    result = cli(*path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    command = " ".join(("outbox-relay", *path))
    assert lines[0].startswith(f"Usage: {command} ")
    error = lines[-1]
    assert error == (
        f"outbox-relay: error: `{command}` needs a command: one of {', '.join(choices)} (see `{command} --help`)"
    )
    assert len(lines) == 2


def test_ctrl_c_during_a_command_exits_130():
    """A one-shot command interrupted (SIGINT, as Ctrl-C sends) exits 130, without a traceback."""
    with socket.socket() as server:
        # A "database" that accepts the connection and never answers: the command waits in
        # its connection attempt until it is interrupted.
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(30)
        port = server.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
        env.update(cli_env(f"host=127.0.0.1 port={port} dbname=x user=x connect_timeout=60", "outbox"))
        process = subprocess.Popen(
            [sys.executable, "-m", "outbox_relay.operator.cli", "status"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            connection, _ = server.accept()  # the command is now waiting for the server's answer
            with connection:
                time.sleep(0.5)
                process.send_signal(signal.SIGINT)
                _, stderr = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
