"""The ``tierckpt`` argument parser and entry point: one function per subcommand, mapped from
errors to the documented exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from tierckpt_client import __version__
from tierckpt_client.cli import _render, listing, manage, verify
from tierckpt_client.cli._tiers import Persistent
from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import (
    DaemonUnavailableError,
    InvalidNameError,
    NotFoundError,
    TierCkptError,
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_UNAVAILABLE = 4
EXIT_VERIFY_FAILED = 5
EXIT_NOT_VERIFIED = 6
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for `cat big | head`

DESCRIPTION = """\
Look at and manage the checkpoints that this node's tierckpt daemon holds in memory and that the
persistent tier holds. Talks to the daemon over its Unix socket (TIERCKPT_SOCKET or --socket);
reads the persistent tier directly (TIERCKPT_PERSIST_URL, else the tier the daemon uses). With
TIERCKPT_PERSIST_URL set and no daemon reachable, ls, inspect, verify and export read that store
alone. Tables by default, --json for scripts; progress goes to stderr."""

EPILOG = """\
exit codes:
  0    success
  1    error reported by the daemon or the persistent tier (also: persist --wait timed out,
       export without torch installed)
  2    usage error: bad argument, invalid namespace or step, missing --yes
  3    not found: no such namespace or step in any tier
  4    the daemon cannot be reached
  5    verify: a file is corrupt or missing
  6    verify: nothing corrupt, but some files have no checksum yet (not verified)
  141  stdout was closed early (e.g. `tierckpt --json ls | head`); nothing is printed
"""

Command = Callable[[DaemonClient, Persistent, argparse.Namespace], None]


def _peer_timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 60]")
    return value


def _parser() -> argparse.ArgumentParser:
    # The common options work before and after the subcommand; SUPPRESS keeps a subcommand's
    # default from overwriting a value given before it (main() fills in the defaults).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--socket",
        default=argparse.SUPPRESS,
        metavar="PATH",
        help="the daemon's Unix socket (default: $TIERCKPT_SOCKET, or $TIERCKPT_SHM_DIR/daemon.sock)",
    )
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the result as JSON on stdout (for scripts; the same as -o json)",
    )
    common.add_argument(
        "-o",
        "--output",
        choices=_render.OUTPUTS,
        default=argparse.SUPPRESS,
        help="table (default), json, wide (a table with more columns) or name (one name per "
        "line: NAMESPACE, NAMESPACE/STEP, NODE/NAMESPACE/STEP)",
    )
    common.add_argument(
        "--no-headers",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print tables without their header row (and without the notes below them)",
    )
    common.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress bars, warnings or confirmation lines; errors are still printed",
    )
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="tierckpt",
        description=DESCRIPTION,
        epilog=EPILOG,
        parents=[common],
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"tierckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Command, summary: str) -> argparse.ArgumentParser:
        s = sub.add_parser(
            name,
            parents=[common],
            help=summary,
            description=summary,
            epilog=EPILOG,
            formatter_class=fmt,
        )
        s.set_defaults(func=func)
        return s

    def namespace(s: argparse.ArgumentParser) -> None:
        s.add_argument("namespace", metavar="NAMESPACE", help="the job's namespace, e.g. llama-7b")

    def step(s: argparse.ArgumentParser, latest: bool = False) -> None:
        if latest:
            s.add_argument(
                "step",
                metavar="STEP",
                help="a step number, or 'latest' (what a restore would pick)",
            )
        else:
            s.add_argument("step", type=int, metavar="STEP", help="the step number")

    s = command("help", _no_command, "show the help of a command: tierckpt help COMMAND")
    s.add_argument("topic", nargs="?", metavar="COMMAND", help="the command (default: tierckpt)")
    command(
        "status",
        listing.cmd_status,
        "capacity, usage, pool, persistent tier, replication and namespaces of this node",
    )
    s = command(
        "ls", listing.cmd_ls, "list namespaces, or the steps of one namespace, in every tier"
    )
    s.add_argument(
        "namespace",
        nargs="?",
        metavar="NAMESPACE",
        help="list this namespace's steps (default: list every namespace)",
    )
    s.add_argument(
        "--cluster",
        action="store_true",
        help="list the steps every node holds in memory: the daemon asks its peers (a node that "
        "does not answer within --timeout is shown as UNREACHABLE)",
    )
    s.add_argument(
        "--timeout",
        type=_peer_timeout,
        default=5.0,
        metavar="SECONDS",
        help="with --cluster: how long to wait for each peer (default 5, at most 60)",
    )
    s = command(
        "inspect",
        listing.cmd_inspect,
        "state, tiers and files of one step (from memory, else the persistent tier)",
    )
    namespace(s)
    step(s)
    s = command(
        "verify",
        verify.cmd_verify,
        "read every file of a step in every tier that holds it and check its checksum",
    )
    namespace(s)
    step(s)
    s = command(
        "rm",
        manage.cmd_rm,
        "remove one step from memory (with --persistent --yes: also from the persistent tier)",
    )
    namespace(s)
    step(s)
    s.add_argument(
        "--persistent",
        action="store_true",
        help="also delete the step from the persistent tier (needs --yes)",
    )
    s.add_argument(
        "--yes", action="store_true", help="confirm --persistent: the deletion cannot be undone"
    )
    s.add_argument(
        "--abandoned",
        action="store_true",
        help="free the step's save attempt that a trainer left when it died mid-save (refused "
        "while its writer runs); `tierckpt inspect` shows it",
    )
    s = command(
        "export",
        manage.cmd_export,
        "write a step as a plain torch DCP checkpoint directory (needs torch)",
    )
    namespace(s)
    step(s, latest=True)
    s.add_argument("dest", metavar="DIR", help="an empty or new directory to write into")
    s = command("persist", manage.cmd_persist, "upload a committed step to the persistent tier now")
    namespace(s)
    step(s)
    s.add_argument(
        "--wait",
        action="store_true",
        help="wait until the step is durable, with a progress bar on stderr",
    )
    s.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="with --wait: give up (exit 1) after this long (default 3600)",
    )
    s = command(
        "prefetch",
        manage.cmd_prefetch,
        "bring a durable step from the persistent tier into memory ahead of a restart",
    )
    namespace(s)
    step(s, latest=True)
    return p


# The commands whose results have names (-o name): namespaces, steps, a node's steps.
NAMED = {"ls", "inspect"}


def _no_command(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    raise AssertionError("tierckpt help is answered before any daemon is reached")


def _help(parser: argparse.ArgumentParser, topic: str | None) -> int:
    """``tierckpt help [COMMAND]``: what ``tierckpt [COMMAND] --help`` prints."""
    if topic is None:
        parser.print_help()
        return EXIT_OK
    try:
        parser.parse_args([topic, "--help"])
    except SystemExit as e:  # argparse exits after printing the help, or on an unknown command
        return EXIT_OK if e.code == 0 else EXIT_USAGE
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # (argparse itself ignores a closed stdout for --help)
    if args.command == "help":
        return _help(parser, args.topic)
    args.socket = getattr(args, "socket", None)
    output = getattr(args, "output", "json" if getattr(args, "json", False) else "table")
    args.json = output == "json"
    if output == "name" and args.command not in NAMED:
        return _fail(EXIT_USAGE, f"-o name: {args.command} has no names to print; use -o json")
    _render.OPTIONS = _render.Options(
        output=output,
        no_headers=getattr(args, "no_headers", False),
        quiet=getattr(args, "quiet", False),
    )
    try:
        config = ClientConfig.from_env(socket=args.socket)
    except ValueError as e:  # a malformed TIERCKPT_* variable
        return _fail(EXIT_USAGE, e)
    try:
        with DaemonClient(config) as client:
            tier = Persistent(client)
            if _daemonless(args, config, client):
                _render.warn(
                    f"the daemon at {config.socket} cannot be reached: reading only the "
                    f"persistent tier {tier.go_offline()} (TIERCKPT_PERSIST_URL)"
                )
            try:
                args.func(client, tier, args)
            finally:
                tier.close()
    except _render.StdoutClosed:
        return _stdout_closed()
    except (InvalidNameError, _render.NoNamesError) as e:
        return _fail(EXIT_USAGE, e)
    except NotFoundError as e:
        return _fail(EXIT_NOT_FOUND, e)
    except DaemonUnavailableError as e:
        return _fail(EXIT_UNAVAILABLE, e)
    except verify.VerifyFailedError as e:
        return _fail(EXIT_VERIFY_FAILED, e)
    except verify.NotVerifiedError as e:
        return _fail(EXIT_NOT_VERIFIED, e)
    except (TierCkptError, OSError) as e:
        return _fail(EXIT_ERROR, e)
    return EXIT_OK


# What a command can do with the persistent tier alone: the operations guide's "look at a store
# from any machine with access to it" (TIERCKPT_PERSIST_URL), with no daemon on that machine.
DAEMONLESS = {"ls", "inspect", "verify", "export"}


def _daemonless(args: argparse.Namespace, config: ClientConfig, client: DaemonClient) -> bool:
    if args.command not in DAEMONLESS or not config.persist_url or getattr(args, "cluster", False):
        return False
    return not client.ping()


def _stdout_closed() -> int:
    # Point stdout at /dev/null so that the interpreter's final flush does not fail again.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_STDOUT_CLOSED


def _fail(code: int, error: BaseException | str) -> int:
    print(f"tierckpt: {error}", file=sys.stderr)
    return code
