"""Parts of a file of a step spanning nodes that another node holds (a reader here needs a
little of a big file): fetched from a peer that holds it, in verified blocks, not whole.

A field of :class:`~tierckpt_daemon.peers.spanning.SpanningReads`.
"""

from __future__ import annotations

from dataclasses import replace

from tierckpt_core.errors import (
    BlockMismatchError,
    CheckpointFormatError,
    ProtocolError,
    StepNotFoundError,
)
from tierckpt_core.verified import BlockSums, check_blocks
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import PEER_ERRORS
from tierckpt_daemon.peers.ring_table import RingTables
from tierckpt_daemon.peers.shares import Shares
from tierckpt_daemon.tier.service import TierService


class Ranges:
    def __init__(
        self, service: TierService, client: PeerClient, tables: RingTables, shares: Shares
    ) -> None:
        self.service = service
        self.client = client
        self.tables = tables
        self.shares = shares

    def read(
        self, node: str, name: str, namespace: str, step: int, ranges: list[tuple[int, int]]
    ) -> bytes:
        """The ``ranges`` (offset, length) of file ``name`` of ``node``'s share of a step
        spanning nodes, which another node holds, concatenated: fetched from a peer that holds
        it (its writer's node first), verified before they leave this daemon. A small item the
        writing rank checksummed comes alone; anything else in whole blocks, each checked
        against the block checksums taken at prepare (from the share's records, fetched from
        its holders and checked against the share's digest)."""
        ring = self.service.record(namespace, step).ring
        if ring is None:
            raise CheckpointFormatError(
                f"{namespace}/step {step}: {name} has no block checksums to verify a range"
            )
        ring = self.tables.table(namespace, step, ring)
        f = self.shares.records(namespace, step, node, ring)[name]
        for off, n in ranges:
            if off < 0 or n < 0 or off + n > f.length:
                raise ProtocolError(f"{namespace}/step {step}: range {off}+{n} is outside {f.name}")
        copies = self.shares.copies(namespace, step, ring, nodes=[node])
        peers = sorted(
            ((p, c.attempt) for p, c in copies.items() if c.held is None or f.name in c.held),
            key=lambda pa: pa[0] != f.node,
        )
        segments = {(off, n): digest for off, n, digest in f.segments or ()}
        parts: dict[tuple[int, int], bytes] = {}
        for off, n in ranges:
            if n and (off, n) in segments:
                alone = BlockSums(f.name, n, n, [segments[(off, n)]], origin=off)
                parts[(off, n)] = self._fetch_verified(peers, namespace, step, off, n, alone)
        rest = [(off, n) for off, n in ranges if n and (off, n) not in parts]
        if rest:
            size = f.block_size
            if not size or f.blocks is None:
                raise CheckpointFormatError(
                    f"{namespace}/step {step}: {f.name} has no block checksums to verify a range"
                )
            wanted = sorted(
                {b for off, n in rest for b in range(off // size, (off + n - 1) // size + 1)}
            )
            runs: list[list[int]] = []
            for b in wanted:
                if runs and runs[-1][-1] == b - 1:
                    runs[-1].append(b)
                else:
                    runs.append([b])
            blocks: dict[int, bytes] = {}
            for run in runs:
                start, end = run[0] * size, min((run[-1] + 1) * size, f.length)
                data = self._fetch_verified(
                    peers, namespace, step, start, end - start, BlockSums.of(f)
                )
                blocks.update({b: data[(b - run[0]) * size : (b - run[0] + 1) * size] for b in run})
            for off, n in rest:
                first = off // size
                buf = b"".join(blocks[b] for b in range(first, (off + n - 1) // size + 1))
                parts[(off, n)] = buf[off - first * size : off - first * size + n]
        return b"".join(parts.get((off, n), b"") for off, n in ranges)

    def _fetch_verified(
        self,
        peers: list[tuple[str, str]],
        namespace: str,
        step: int,
        start: int,
        length: int,
        sums: BlockSums,
    ) -> bytes:
        """``length`` bytes at ``start`` of a file (whole blocks of ``sums``) from the first of
        ``peers`` (each with the attempt id of its copy) whose bytes match their checksums."""
        errors = []
        where = f"{namespace}/step {step}"
        for peer, attempt in peers:
            try:
                data = self.client.read_range(
                    peer, namespace, step, attempt, sums.name, start, length
                )
            except PEER_ERRORS as e:
                errors.append(f"{peer}: {e}")
                continue
            if len(data) != length:
                errors.append(f"{peer}: sent {len(data)} bytes of {sums.name} for {length}")
                continue
            try:
                check_blocks(data, replace(sums, where=where, source=f"in peer {peer}"), start)
            except BlockMismatchError as e:
                self.service.metrics.verification_failures.labels(tier="peer").inc()
                errors.append(str(e))
                continue
            self.service.metrics.peer_hydrated_bytes.inc(len(data))
            return data
        raise StepNotFoundError(
            f"{where}: no peer could send {sums.name} bytes {start}-{start + length} "
            f"({'; '.join(errors) or 'no peer holds it'})"
        )
