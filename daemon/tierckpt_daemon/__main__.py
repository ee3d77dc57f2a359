"""``tierckpt-daemon``: run the node-local checkpoint daemon.

Every flag has an environment twin ``TIERCKPT_<NAME>``; a flag wins over the environment.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from typing import Any

from pydantic import ValidationError

from tierckpt_daemon import __version__
from tierckpt_daemon.logfields import fields_of


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **fields_of(record),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def _configure_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO: one line per file pushed to or fetched from a peer.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt-daemon", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"tierckpt-daemon {__version__}")
    p.add_argument("--shm-dir", help="tmpfs directory of the memory tier [TIERCKPT_SHM_DIR]")
    p.add_argument("--socket", help="Unix socket for local clients [TIERCKPT_SOCKET]")
    p.add_argument("--capacity", help="budget: '40%%' of node memory or bytes like '16G'")
    p.add_argument("--keep-last", type=int, help="committed steps kept per namespace")
    p.add_argument("--host", help="bind address of the TCP port [TIERCKPT_HOST]")
    p.add_argument("--port", type=int, help="TCP port for probes, 0 = off [TIERCKPT_PORT]")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ... [TIERCKPT_LOG_LEVEL]")
    p.add_argument("--log-json", action="store_true", default=None, help="JSON log lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    from tierckpt_daemon.config import DaemonSettings
    from tierckpt_daemon.server import DaemonStartError, serve

    try:
        settings = DaemonSettings(**overrides)
    except ValidationError as e:
        for err in e.errors():
            print(f"tierckpt-daemon: {_setting_error(err)}", file=sys.stderr)
        return 2
    _configure_logging(settings.log_level, settings.log_json)
    from tierckpt_core.errors import TierCkptError
    from tierckpt_daemon.server import SettingError
    from tierckpt_daemon.startup import check_environment

    unknown = check_environment(settings, os.environ)
    if unknown and settings.strict_settings:
        for message in unknown:
            print(
                f"tierckpt-daemon: {message}; not starting (TIERCKPT_STRICT_SETTINGS is on)",
                file=sys.stderr,
            )
        return 2
    try:
        serve(settings)
    except SettingError as e:
        print(f"tierckpt-daemon: invalid setting {e}", file=sys.stderr)
        return 2
    except (DaemonStartError, TierCkptError) as e:
        logging.getLogger("tierckpt_daemon").error("%s", e)
        return 1
    return 0


def _setting_error(err: Any) -> str:
    """One line for a refused setting, naming its variable (``TIERCKPT_CAPACITY``); errors of
    several settings together name theirs in the message."""
    msg = str(err["msg"]).removeprefix("Value error, ")
    loc = [str(x) for x in err["loc"]]
    # A setting read while another is checked (TIERCKPT_S3_ENDPOINT, by TIERCKPT_PERSIST_URL's
    # check) is named by its message: that one is the setting to fix.
    if own := re.match(r"invalid ((?:TIERCKPT|AWS)_[A-Z0-9_]+) (.*)", msg, re.S):
        return f"invalid setting {own[1]}: {own[2]}"
    if not loc:
        return f"invalid setting: {msg}"
    return f"invalid setting TIERCKPT_{'_'.join(loc).upper()}: {msg}"


if __name__ == "__main__":
    sys.exit(main())
