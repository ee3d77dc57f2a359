"""Daemon settings: environment variables ``TIERCKPT_*`` (names match the Helm values) or flags.

Settings are read once in ``__main__`` and passed down; nothing reads the environment at import time.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tierckpt_daemon.paths import (
    check_socket_length,
    resolved_parents,
    tier_dir,
)
from tierckpt_daemon.peers.tls import PeerTLS

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Parse ``"1073741824"``, ``"512M"``, ``"8G"``, ``"1.5GiB"`` into bytes (binary units)."""
    m = _SIZE_RE.fullmatch(text)
    if not m:
        raise ValueError(
            f"cannot parse size {text!r}: use bytes with an optional K/M/G/T suffix, e.g. '8G'"
        )
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I") or ""
    return int(float(m.group(1)) * _UNITS[unit])


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Below this a tier holds no real checkpoint: a bare number under it is most likely a unit left out
# (TIERCKPT_CAPACITY=40 is 40 bytes), so it is refused; with a unit it is taken as meant.
CAPACITY_FLOOR = 64 << 20


def check_capacity_floor(text: str) -> None:
    """Refuse a capacity that is a bare number of bytes below :data:`CAPACITY_FLOOR`."""
    t = text.strip()
    if t.replace(".", "", 1).isdigit() and parse_size(t) < CAPACITY_FLOOR:
        raise ValueError(
            f"{t!r} is {parse_size(t)} bytes, below the {CAPACITY_FLOOR >> 20} MiB a memory tier "
            f"needs: did you mean '{t}G'? Write the unit ('{t}M', '{t}B') to mean a small tier"
        )


def node_memory_bytes() -> int:
    """Memory this daemon can use: the node's MemTotal, or the cgroup limit if that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
        break
    return total


def parse_capacity(text: str, node_bytes: int | None = None) -> int:
    """``"40%"`` of node memory (cgroup-aware) or an absolute size such as ``"16G"``."""
    text = text.strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"cannot parse capacity {text!r}: use e.g. '40%' or '16G'") from None
        if not 0 < pct <= 100:
            raise ValueError(f"capacity percent must be in (0, 100], got {text!r}")
        return int((node_bytes if node_bytes is not None else node_memory_bytes()) * pct / 100)
    return parse_size(text)


class DaemonSettings(BaseSettings):
    """All daemon settings. Environment: ``TIERCKPT_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="TIERCKPT_", extra="ignore")

    shm_dir: Path = Field(
        default=Path("/dev/shm/tierckpt"),
        description="tmpfs directory that holds the memory tier (shared with the trainers)",
    )
    socket: Path | None = Field(
        default=None, description="Unix socket for local clients (default <shm_dir>/daemon.sock)"
    )
    capacity: str = Field(
        default="40%",
        description="memory tier budget: bytes with K/M/G/T suffix or % of node memory",
    )
    keep_last: int = Field(default=2, ge=1, description="committed steps kept per namespace")
    host: str = Field(default="127.0.0.1", description="bind address of the TCP port")
    port: int = Field(default=8474, ge=0, le=65535, description="TCP port (probes); 0 = off")
    head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="a connection to the TCP port that has not sent a whole request head this "
        "long after it opened, or after the first byte of its next request, is closed (one that "
        "sends a head a byte at a time could otherwise hold a connection, a descriptor and "
        "memory for good)",
    )
    lease_ttl_s: float = Field(
        default=900.0, gt=0, description="an unsealed lease or unfinished step expires after this"
    )
    prefault: bool = Field(default=True, description="allocate tmpfs pages when a file is created")
    persist_url: str | None = Field(
        default=None,
        description="persistent tier: s3://bucket/prefix or file:///path (unset: memory only)",
    )
    persist_every: int = Field(
        default=1, ge=1, description="persist every k-th committed step unless the save says"
    )
    persist_keep_last: int = Field(
        default=0,
        ge=0,
        description="durable steps kept per namespace in the persistent tier (0: all)",
    )
    upload_concurrency: int = Field(default=4, ge=1, le=64, description="files uploaded at once")
    upload_max_rate: str | None = Field(
        default=None,
        description="cap on upload bandwidth, bytes per second with K/M/G suffix (unset: none)",
    )
    background_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="niceness of the threads that upload, hydrate and push replicas (0-19): when "
        "training and a transfer want the same core, training goes first (0: normal priority)",
    )
    drain_timeout_s: float = Field(
        default=90.0, ge=0, description="on SIGTERM, wait this long for queued uploads"
    )
    peers: str | None = Field(
        default=None,
        description="every daemon's TCP endpoint, 'host:port,host:port,...' (the same list on "
        "every node), or 'dns:<name>:<port>' of a headless Service (unset: no replication)",
    )
    node_name: str | None = Field(
        default=None,
        description="this daemon's own entry among the peers (default <host>:<port>)",
    )
    replicas: int = Field(
        default=1, ge=0, le=16, description="push each committed step to the next k peers (0: off)"
    )
    peer_token: SecretStr | None = Field(
        default=None, description="shared secret of the daemon-to-daemon routes"
    )
    peer_token_file: Path | None = Field(
        default=None, description="file holding the peer token (a mounted Secret)"
    )
    peer_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="connect timeout, and longest wait for the next bytes, of every peer call",
    )
    peer_list_timeout_s: float = Field(
        default=3.0,
        gt=0,
        le=600,
        description='how long "latest" (a restore\'s first call) and a restore from peers wait '
        "for the peers asked to list the steps they hold; a peer that has not answered by then "
        "is left out (named in a WARNING) and not asked again until its request ends",
    )
    decider_gone_s: float = Field(
        default=600.0,
        ge=0,
        description="a save attempt prepared here whose decider (another node) has not been a "
        "member of the ring for this long is aborted, unless a member holds it committed",
    )
    decision_resend_s: float = Field(
        default=900.0,
        gt=0,
        description="a commit across nodes: a decision a participant did not take is sent to it "
        "again, less and less often (2 s doubling to 60 s), for this long at most; not at all "
        "once it answers that it cannot take it",
    )
    commit_fanout: int = Field(
        default=8,
        ge=2,
        le=1024,
        description="a commit across nodes: nodes the decider (and each relay) sends the prepare "
        "and the decision to, each passing them on to its part of the rest (a tree)",
    )
    replication_concurrency: int = Field(
        default=4, ge=1, le=64, description="files pushed to peers at once"
    )
    replication_max_rate: str | None = Field(
        default=None,
        description="cap on the bytes this daemon takes in as replicas of its peers' steps, all "
        "at once, bytes per second with K/M/G suffix: leave the training job's network its share "
        "(unset: none)",
    )
    replication_inflight_bytes: int = Field(
        default=4 << 20,
        gt=0,
        description="a paced transfer's most bytes at once ahead of its rate (the token bucket's "
        "depth, and the largest single read), bytes with K/M/G suffix",
    )
    peer_fetch_max_rate: str | None = Field(
        default=None,
        description="cap on the bytes a restore fetches from peers, bytes per second with K/M/G "
        "suffix (unset: none; a restore is what the job waits for)",
    )
    peer_tls_cert: Path | None = Field(
        default=None,
        description="PEM certificate (chain) this daemon presents on its TCP port and to peers; "
        "with the key and CA it turns TLS on for the whole TCP port (unset: plain HTTP)",
    )
    peer_tls_key: Path | None = Field(
        default=None, description="PEM private key of TIERCKPT_PEER_TLS_CERT"
    )
    peer_tls_ca: Path | None = Field(
        default=None,
        description="PEM CA certificate(s) every peer's certificate must be issued by",
    )
    peer_tls_server_name: str | None = Field(
        default=None,
        description="the name every peer's certificate must carry (unset: the host of the "
        "peer's address, a DNS name or an IP address)",
    )
    peer_max_record_bytes: int = Field(
        default=256 << 20,
        gt=0,
        description="largest body of a commit record a peer sends (prepare, decision: the job's "
        "metadata and block checksums), bytes with K/M/G suffix; larger is refused (413) unread",
    )
    peer_max_body_bytes: int = Field(
        default=1 << 20,
        gt=0,
        description="largest body of any other request on the TCP port (413 unread above it)",
    )
    handoff_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="a trainer on the handoff socket sends its whole request line within this",
    )
    metrics_namespace_labels: Literal["hashed", "plain", "off"] = Field(
        default="hashed",
        description="the namespace label of the per-namespace gauges on the unauthenticated "
        "/metrics: a short hash of the name, the name itself, or no per-namespace series",
    )
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING, ERROR")
    log_json: bool = Field(default=False, description="one JSON object per log line")
    strict_settings: bool = Field(
        default=False,
        description="refuse to start (exit 2) on a TIERCKPT_* variable that is no setting of the "
        "daemon, the S3 tier or the trainers (a misspelt one); unset: a WARNING naming the "
        "closest setting",
    )

    capacity_bytes: int = Field(default=0, exclude=True)
    peer_secret: SecretStr | None = Field(default=None, exclude=True)  # from token or file
    peer_tls: PeerTLS | None = Field(default=None, exclude=True)  # from the peer_tls_* files

    @field_validator("capacity")
    @classmethod
    def _check_capacity(cls, v: str) -> str:
        parse_capacity(v, node_bytes=1 << 30)  # syntax check only
        check_capacity_floor(v)
        return v

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, v: str) -> str:
        level = v.strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"{v!r} is not one of {', '.join(LOG_LEVELS)}")
        return level

    @field_validator("shm_dir")
    @classmethod
    def _check_shm_dir(cls, v: Path) -> Path:
        return tier_dir("TIERCKPT_SHM_DIR", v)

    @field_validator("socket")
    @classmethod
    def _check_socket(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        v = resolved_parents(v)
        check_socket_length(v, "set TIERCKPT_SOCKET to a shorter path")
        return v

    @field_validator("persist_url")
    @classmethod
    def _check_persist_url(cls, v: str | None) -> str | None:
        if v:
            from tierckpt_core.errors import TierCkptError
            from tierckpt_core.objectstore import open_store

            try:
                open_store(v).close()  # parses the URL; clients are created on first use
            except TierCkptError as e:
                raise ValueError(str(e)) from None
        return v

    @field_validator(
        "peer_max_record_bytes",
        "peer_max_body_bytes",
        "replication_inflight_bytes",
        mode="before",
    )
    @classmethod
    def _parse_byte_size(cls, v: object) -> object:
        return parse_size(v) if isinstance(v, str) else v

    @field_validator("upload_max_rate", "replication_max_rate", "peer_fetch_max_rate")
    @classmethod
    def _check_rate(cls, v: str | None) -> str | None:
        if v:
            parse_size(v)
        return v

    @model_validator(mode="after")
    def _derive(self) -> DaemonSettings:
        if self.socket is None:
            self.socket = self.shm_dir / "daemon.sock"
            check_socket_length(
                self.socket, "set TIERCKPT_SOCKET to a shorter path, or shorten TIERCKPT_SHM_DIR"
            )
        self.capacity_bytes = parse_capacity(self.capacity)
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity {self.capacity!r} resolves to {self.capacity_bytes} bytes")
        self._derive_peers()
        return self

    def _derive_peers(self) -> None:
        from tierckpt_daemon.peers.membership import Membership, format_member, normalize_member

        self.peer_secret = _read_token(self.peer_token, self.peer_token_file)
        self.peer_tls = PeerTLS.from_settings(
            self.peer_tls_cert, self.peer_tls_key, self.peer_tls_ca, self.peer_tls_server_name
        )
        if self.peer_tls is not None and not self.port:
            raise ValueError("TIERCKPT_PEER_TLS_* is set but the TCP port is off (TIERCKPT_PORT 0)")
        if not self.peers:
            return
        membership = Membership.parse(self.peers)
        if self.peer_secret is None:
            raise ValueError(
                "TIERCKPT_PEERS is set, so TIERCKPT_PEER_TOKEN (or TIERCKPT_PEER_TOKEN_FILE) is "
                "required: the same secret on every daemon guards the peer routes"
            )
        if not self.port:
            raise ValueError("TIERCKPT_PEERS needs the TCP port (TIERCKPT_PORT is 0)")
        if self.node_name is None:
            if self.host in ("0.0.0.0", "::", ""):
                raise ValueError(
                    f"TIERCKPT_HOST is {self.host!r}, which peers cannot dial: set "
                    "TIERCKPT_NODE_NAME to this daemon's host:port as the peers reach it"
                )
            self.node_name = format_member(self.host, self.port)
        try:
            self.node_name = normalize_member(self.node_name)
        except ValueError as e:
            raise ValueError(f"TIERCKPT_NODE_NAME: {e}") from None
        if membership.static and self.node_name not in membership.static:
            raise ValueError(
                f"TIERCKPT_NODE_NAME {self.node_name} is not one of TIERCKPT_PEERS "
                f"({membership.describe()}): every daemon must find itself on the ring"
            )

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, v: str | None) -> str | None:
        if v and v.strip():
            from tierckpt_daemon.peers.membership import Membership

            Membership.parse(v)
            return v.strip()
        return None

    @property
    def socket_path(self) -> Path:
        assert self.socket is not None
        return self.socket


MIN_TOKEN_CHARS = 16


def _read_token(token: SecretStr | None, path: Path | None) -> SecretStr | None:
    if token is not None and path is not None:
        raise ValueError("set TIERCKPT_PEER_TOKEN or TIERCKPT_PEER_TOKEN_FILE, not both")
    if path is not None:
        try:
            token = SecretStr(path.read_text().strip())
        except OSError as e:
            raise ValueError(f"TIERCKPT_PEER_TOKEN_FILE {path}: {e.strerror}") from None
    if token is None:
        return None
    value = token.get_secret_value()
    if value.startswith("REPLACE-ME"):
        raise ValueError(
            "the peer token is still the placeholder of deploy/kubernetes/secret.yaml: set a "
            "random one, e.g. `openssl rand -hex 24`"
        )
    if len(value) < MIN_TOKEN_CHARS or any(c.isspace() for c in value):
        # Never echo the token itself.
        raise ValueError(
            f"TIERCKPT_PEER_TOKEN must be at least {MIN_TOKEN_CHARS} characters without "
            f"whitespace (got {len(value)} characters); e.g. `openssl rand -hex 24`"
        )
    return token
