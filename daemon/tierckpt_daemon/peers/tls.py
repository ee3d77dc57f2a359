"""TLS for the peer port (optional): the certificate this daemon presents, its key, and the CA that
every peer's certificate must chain to.

With TLS on, the whole TCP port speaks HTTPS (peer routes, probes, metrics). The daemon verifies
the certificate of every peer it calls against the CA, and the peer's address (or
``TIERCKPT_PEER_TLS_SERVER_NAME``) against the certificate's names, so the peer token is only ever
sent to a daemon that holds a key the CA vouched for. It also presents its own certificate when it
calls; a caller that presents a certificate from another CA is refused at the handshake. Callers
that present none (kubelet probes, Prometheus) still get the public routes; the peer routes keep
requiring the token.

The files are read at start (a restart picks up renewed certificates) and checked there: a
daemon with half of the settings, an unreadable file or a key that does not match its certificate
does not start.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

SETTINGS = ("TIERCKPT_PEER_TLS_CERT", "TIERCKPT_PEER_TLS_KEY", "TIERCKPT_PEER_TLS_CA")


@dataclass(frozen=True)
class PeerTLS:
    """The peer port's TLS files; ``server_name``: the name every peer's certificate must carry
    (None: the host part of the peer's address, a DNS name or an IP address)."""

    cert: Path
    key: Path
    ca: Path
    server_name: str | None = None

    @classmethod
    def from_settings(
        cls, cert: Path | None, key: Path | None, ca: Path | None, server_name: str | None
    ) -> PeerTLS | None:
        """The TLS settings, or None when TLS is off; ``ValueError`` saying what is wrong when
        only some are given, a file cannot be read, or the files do not make a usable pair."""
        given = dict(zip(SETTINGS, (cert, key, ca), strict=True))
        if not any(given.values()):
            if server_name:
                raise ValueError(
                    "TIERCKPT_PEER_TLS_SERVER_NAME is set but TLS is off: set "
                    f"{', '.join(SETTINGS)} too"
                )
            return None
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(
                f"TLS on the peer port needs {', '.join(SETTINGS)} together; "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
            )
        assert cert is not None and key is not None and ca is not None
        for name, path in given.items():
            assert path is not None
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise ValueError(f"{name} {path}: cannot read it ({e.strerror})") from None
        tls = cls(cert, key, ca, server_name or None)
        tls.server_context()  # loads every file: a bad PEM or a mismatched key fails here
        tls.client_context()
        return tls

    def _load(self, context: ssl.SSLContext) -> ssl.SSLContext:
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_verify_locations(cafile=self.ca)
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(
                f"TIERCKPT_PEER_TLS_CA {self.ca}: no usable PEM certificate in it ({e})"
            ) from None
        try:
            context.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as e:
            raise ValueError(
                f"TIERCKPT_PEER_TLS_CERT {self.cert} and TIERCKPT_PEER_TLS_KEY {self.key}: not a "
                f"PEM certificate and its private key ({e.reason or e})"
            ) from None
        return context

    def server_context(self) -> ssl.SSLContext:
        """For the TCP port: present the certificate; a caller's certificate is optional (probes
        have none) but, when presented, must chain to the CA."""
        context = self._load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
        context.verify_mode = ssl.CERT_OPTIONAL
        return context

    def client_context(self) -> ssl.SSLContext:
        """For calls to peers: the peer's certificate must chain to the CA and carry the peer's
        name (or ``server_name``); this daemon presents its own certificate."""
        context = self._load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def expected_name(self, peer: str) -> str:
        """The name ``peer``'s certificate must carry (``host:port`` or ``[v6]:port``)."""
        if self.server_name:
            return self.server_name
        host = peer.rsplit(":", 1)[0]
        return host[1:-1] if host.startswith("[") else host


def describe_tls_error(peer: str, error: BaseException, tls: PeerTLS | None) -> str | None:
    """A sentence for a TLS failure somewhere in ``error``'s causes, or None if there is none."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ssl.SSLCertVerificationError):
            why = e.verify_message or e.reason or str(e)
            ca = f" (TIERCKPT_PEER_TLS_CA {tls.ca})" if tls is not None else ""
            name = f" for the name {tls.expected_name(peer)!r}" if tls is not None else ""
            return (
                f"peer {peer}: its TLS certificate was refused: {why}; it must be issued by "
                f"this daemon's CA{ca}{name}"
            )
        if isinstance(e, ssl.SSLError) and e.reason == "WRONG_VERSION_NUMBER":
            return (
                f"peer {peer}: it does not speak TLS (plain HTTP answered the handshake): set "
                f"{', '.join(SETTINGS)} on every daemon of the ring, or on none"
            )
        if isinstance(e, ssl.SSLError):
            return (
                f"peer {peer}: the TLS handshake failed ({e.reason or e}); a peer that refuses "
                "this daemon's certificate trusts another CA: every daemon needs certificates "
                "from the same TIERCKPT_PEER_TLS_CA"
            )
        e = e.__cause__ or e.__context__
    return None
