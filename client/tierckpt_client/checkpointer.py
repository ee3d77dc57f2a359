"""``Checkpointer``: the training-loop glue every team otherwise re-writes around DCP.

A loop needs more than a storage writer: one save in flight at a time whose failure is never
dropped, a cadence, "latest" restored on start and agreed by all ranks, a process group of its own
for checkpoint collectives (a THREAD-mode save that shares the training group with FSDP's
collectives deadlocks), and a last durable save when the scheduler preempts the job (see
:mod:`tierckpt_client._preemption`). This module is that glue, once.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import gc
import logging
import signal
import sys
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tierckpt_client import _fresh, _gc_pause, _load_plan, _local_load, _stateful
from tierckpt_client._preemption import (
    Outcome,
    PreemptionWatcher,
    memory_only_warning,
    not_replicated,
    replicates,
    wait_durable,
)
from tierckpt_client._save_loop import (
    ASYNC_MODES,
    SaveFailedError,
    SaveInFlight,
    caching_planner,
    check_save_options,
    forget_plans,
    staging_done,
)
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _async_staging
from tierckpt_client.dcp._plan_data import WAITS
from tierckpt_core.errors import NamespaceNotFoundError, StepNotFoundError, TierCkptError
from tierckpt_core.protocol import validate_namespace

logger = logging.getLogger(__name__)

MAX_REPLICA_WAIT_S = 3600.0  # the longest wait for replicas a daemon takes

# Groups created for checkpointing, keyed by the ranks of the group they serve: created once per
# process (creating a group is a collective every rank must join), reused by every Checkpointer.
_GROUPS: dict[tuple[int, ...], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
_GROUPS_LOCK = threading.Lock()
# Every Checkpointer alive: at exit their references to the groups are dropped as well.
_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def checkpoint_groups(
    process_group: dist.ProcessGroup | None,
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """The group for DCP's collectives and a second one for the preemption flag.

    The flag is all-reduced from the training thread while a THREAD-mode save may be running
    DCP's collectives on the checkpoint group in a background thread; two threads issuing
    collectives on one group interleave differently on each rank, so the flag has its own group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    with _GROUPS_LOCK:
        if ranks not in _GROUPS:
            ckpt = process_group or dist.new_group(ranks=list(ranks), backend="gloo")
            flag = dist.new_group(ranks=list(ranks), backend="gloo")
            _GROUPS[ranks] = (ckpt, flag)
            _destroy_at_exit()
        ckpt, flag = _GROUPS[ranks]
    return (process_group or ckpt), flag


class Checkpointer:
    """Save a training loop's state every ``every`` steps and restore the newest on start.

    Args:
        namespace: the job's namespace (letters, digits, ``.``, ``_``, ``-``).
        every: save when ``step % every == 0``; other steps return at once.
        persist_every: steps with ``step % persist_every == 0`` are saved with ``persist=True``
            (the daemon uploads them to the persistent tier), the others with ``persist=False``;
            ``None`` leaves every step to the daemon's policy (``TIERCKPT_PERSIST_EVERY``).
        process_group: the group for checkpoint collectives; by default a dedicated gloo group
            over all ranks, created once per process. Never pass the group FSDP trains on.
        async_mode: ``"thread"`` (the save runs in a thread of this process) or ``"process"``
            (DCP's helper process: no GIL contention with the training step; needs
            ``torch.distributed`` initialized first, ValueError otherwise).
        config: how to reach the daemon (default :meth:`ClientConfig.from_env`).
        on_unavailable: what a save does without a daemon (see :class:`TieredStorageWriter`).
        preempt_signal: a signal besides SIGTERM that means "save and exit" (e.g.
            ``signal.SIGUSR1`` with Slurm's ``--signal``); ``None``: SIGTERM only.
        handle_signals: install the handlers (only possible from the main thread).
        preempt_deadline_s: how long a preempted save may take to become durable before the
            process exits anyway (with status 1). A daemon with no persistent tier: the save is
            done once it is committed in memory (exit 0, with one warning), and where that
            daemon replicates, once its replicas are there (``wait="replicated"``, within the
            deadline; status 1 if they are not).
        async_staging: copy the state into the tier while the loop goes on (default:
            ``config.async_staging``, ``TIERCKPT_ASYNC_STAGING``, on). ``False``: ``save``
            returns once the state is copied.
        wait: when a save counts as done: ``"committed"`` (default) or ``"replicated"`` (every
            share of the step also has its replicas on peers); see
            :class:`TieredStorageWriter`.

    ``save(step, state)`` returns at once with ``async_staging``: the copy of the state into
    the node's memory tier runs during the next forward and backward, and every optimizer's
    next ``step()`` waits for it before it changes the parameters (a global pre-step hook), as
    does :meth:`wait_staged`. Anything else that changes the state in place before then (a
    tensor changed by hand, a buffer over 1 MiB a forward changes) must come after
    ``wait_staged()``: a change the copy sees fails that save with
    ``StagingRaceError`` (raised by the next ``save`` as :class:`SaveFailedError`), never a
    torn step. Without it, ``save`` returns once the state is copied. The rest of the save runs
    in the background. The next save first waits for it and raises its error
    (:class:`SaveFailedError`) rather than dropping it; that call does not start its own save (call
    it again to save that step). ``state`` maps names to tensors, dicts,
    or ``Stateful`` objects (their ``state_dict``/``load_state_dict`` are called), as DCP takes it.

    ``save`` copies the modules' buffers of up to 1 MiB (BatchNorm's running statistics, which a
    forward changes) itself before it returns (``_async_staging.forward_buffers``).

    Every rank calls ``save`` with the same steps: each call (off-cadence ones too) all-reduces a
    one-element flag (a signal arrived on some rank), so a preemption is acted on at the same step
    everywhere; ``handle_signals=False`` drops the handlers and this collective.
    """

    def __init__(
        self,
        namespace: str,
        *,
        every: int = 1,
        persist_every: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        async_mode: str = "thread",
        config: ClientConfig | None = None,
        on_unavailable: str = "persist",
        preempt_signal: int | None = None,
        handle_signals: bool = True,
        preempt_deadline_s: float = 300.0,
        async_staging: bool | None = None,
        wait: str = "committed",
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        check_save_options(persist_every, async_mode)
        if preempt_deadline_s <= 0:
            raise ValueError(f"preempt_deadline_s must be > 0, got {preempt_deadline_s}")
        self.namespace = validate_namespace(namespace)
        self.every = every
        self.persist_every = persist_every
        self.async_mode = async_mode
        self.config = config or ClientConfig.from_env()
        self.on_unavailable = on_unavailable
        self.async_staging = self.config.async_staging if async_staging is None else async_staging
        self.preempt_deadline_s = preempt_deadline_s
        if wait not in WAITS:
            raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
        self.wait_for = wait
        self.process_group, self._flag_group = checkpoint_groups(process_group)
        if async_mode == "process" and self.process_group is None:
            # torch's helper process joins the trainer's process group: without one, the first
            # save failed inside torch, and the helper took the interpreter down with it.
            raise ValueError(
                "async_mode='process' needs torch.distributed initialized before the "
                "Checkpointer is made (DCP's save process joins the job's process group): call "
                "torch.distributed.init_process_group() first, or use async_mode='thread'"
            )
        # Our own gloo group (or none): THREAD saves run on one long-lived thread (_save_thread).
        self._own_group = process_group is None
        self._saver: concurrent.futures.ThreadPoolExecutor | None = None
        self._plans = f"tierckpt/{self.namespace}/{id(self):x}"  # DCP's plan caches' key
        _LIVE.add(self)
        self._inflight = SaveInFlight(self.namespace)
        self.last_saved_step: int | None = None  # the newest step whose save has been started
        self._closed = False
        signals: list[int] = [signal.SIGTERM]
        if preempt_signal is not None and preempt_signal != signal.SIGTERM:
            signals.append(preempt_signal)
        self._watcher = PreemptionWatcher(signals if handle_signals else [])
        self._watcher.install()

    # -- context manager -----------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            # Do not mask the loop's own error with a save's; still let the save finish.
            try:
                self.close()
            except Exception:
                logger.exception("%s: the last save failed while another error unwound", self)

    def __repr__(self) -> str:
        return f"Checkpointer({self.namespace!r}, every={self.every})"

    # -- saving --------------------------------------------------------------------------
    @property
    def no_dist(self) -> bool:
        return self.process_group is None

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start saving ``state`` as ``step`` if the step is on the cadence (see the class)."""
        self._check_open()
        if self.preempt_requested():
            self._preempt(step, state)
        if step % self.every != 0:
            return
        self._start(step, state, persist=self._persist(step))

    def _persist(self, step: int) -> bool | None:
        if self.persist_every is None:
            return None
        return step % self.persist_every == 0

    def _start(
        self,
        step: int,
        state: dict[str, Any],
        *,
        persist: bool | None,
        wait: str | None = None,
        replicated_timeout_s: float = 300.0,
    ) -> None:
        self.wait()
        writer = TieredStorageWriter(
            self.namespace,
            step,
            persist=persist,
            config=self.config,
            on_unavailable=self.on_unavailable,
            async_staging=self.async_staging,
            wait=wait or self.wait_for,
            replicated_timeout_s=replicated_timeout_s,
            copied_at_stage=_async_staging.forward_buffers(state) if self.async_staging else (),
        )
        if self.async_mode == "thread" and self._own_group:
            result: Any = self._save_thread(writer, state)
        else:
            result = dcp.async_save(
                state,
                storage_writer=writer,
                planner=caching_planner(self._plans, self.config.pause_gc),
                process_group=self.process_group,
                async_checkpointer_type=ASYNC_MODES[self.async_mode],
                no_dist=self.no_dist,
            )
        self._inflight.start(step, result)
        self.last_saved_step = step

    def _save_thread(
        self, writer: TieredStorageWriter, state: dict[str, Any]
    ) -> concurrent.futures.Future[Any] | AsyncSaveResponse:
        """What ``dcp.async_save`` does in THREAD mode (``Stateful`` values turned into their
        state dicts, the writer's ``stage`` on this thread, then DCP's save of what it staged
        in the background), with one long-lived thread for every save instead of a new thread
        per save, and nothing after the hand-over on this thread. Measured on a quiet 16-core
        host: a 1 GiB stall 0.91x a memcpy of the state against ``async_save``'s 1.05x; the
        difference is the thread start and DCP's per-key wrappers, and this thread's Python
        after the new thread has begun the save and holds the GIL (docs/benchmarks.md). Used
        with the Checkpointer's own checkpoint group only (a group given by the caller goes
        through ``async_save``, which checks that it has a CPU backend)."""
        staged = writer.stage(_stateful.state_dicts(state))
        if self._saver is None:
            self._saver = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"tierckpt-save-{self.namespace}"
            )
        if isinstance(staged, concurrent.futures.Future):  # staged asynchronously
            upload = self._saver.submit(self._save_staged, writer, staged)
            return AsyncSaveResponse(
                staging_completion=staging_done(staged), upload_completion=upload
            )
        return self._saver.submit(self._save_staged, writer, staged)

    def _save_staged(self, writer: TieredStorageWriter, staged: Any) -> Any:
        if isinstance(staged, concurrent.futures.Future):
            staged = staged.result()
        return _stateful.save(
            staged,
            storage_writer=writer,
            planner=caching_planner(self._plans, self.config.pause_gc),
            process_group=self.process_group,
            no_dist=self.no_dist,
        )

    def wait_staged(self) -> None:
        """Return once the save in flight has copied the state (at once without one, or when
        it was staged synchronously): call it before changing the state in place outside an
        optimizer's ``step()``, which waits by itself. Its failure is raised by :meth:`wait`."""
        self._inflight.wait_staged()

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise :class:`SaveFailedError` if it failed."""
        self._inflight.wait()

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and remove the signal handlers."""
        if self._closed:
            return
        self._closed = True
        idle = False
        try:
            self.wait()
            idle = True
        finally:
            self._watcher.uninstall()
            if self._saver is not None:
                # Its last save ended once wait() returned: the thread is joined. A wait that
                # failed may have left a stage that never finished: then it is not waited for.
                self._saver.shutdown(wait=idle)
            forget_plans(self._plans)

    def _check_open(self) -> None:
        if self._closed:
            raise TierCkptError(f"{self.namespace}: this Checkpointer is closed")

    # -- restoring -----------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest step in any tier into ``state`` (in place; ``Stateful`` values get
        ``load_state_dict``); all ranks load the same step. Returns it, or None when the
        namespace has no step yet (a fresh start: ``state`` is left as it is)."""
        self._check_open()
        self.wait()
        reader = TieredStorageReader(
            self.namespace, config=self.config, process_group=self.process_group
        )
        try:
            # "latest" resolved on rank 0 and broadcast, kept for the load. It stays "latest":
            # a step found corrupt while it is read falls back to the newest older one that
            # verifies, on every rank together.
            reader.resolve()
        except (NamespaceNotFoundError, StepNotFoundError) as e:
            _fresh.starting_fresh(logger, self.namespace, e, self.config)
            return None
        try:
            self._load(state, reader)
        except CheckpointException as e:
            older = _fallback_step(e)
            if older is None:
                raise
            # That older step was saved with another layout than the corrupt one, so the load's
            # plan could not serve it: plan again, on that step (the same on every rank: every
            # rank sees every rank's failure).
            logger.warning("%s: loading step %d with a plan of its own", self.namespace, older)
            reader = TieredStorageReader(
                self.namespace, older, config=self.config, process_group=self.process_group
            )
            self._load(state, reader)
        step = reader.resolved_step
        assert step is not None
        self.last_saved_step = step
        logger.info("%s: restored step %d", self.namespace, step)
        return step

    def _load(self, state: dict[str, Any], reader: TieredStorageReader) -> None:
        with _gc_pause.paused(self.config.pause_gc):  # DCP's planning as well as the read
            _stateful.load(
                state,
                storage_reader=reader,
                process_group=self.process_group,
                no_dist=self.no_dist,
                planner=_load_plan.LoadPlanner(),
                loader=_local_load.loader(self.process_group, self.no_dist),
            )

    # -- preemption ----------------------------------------------------------------------
    def preempt_requested(self) -> bool:
        """Whether any rank received a preemption signal (a collective on every rank)."""
        return self._watcher.agreed(self._flag_group)

    def _preempt(self, step: int, state: dict[str, Any]) -> None:
        """Finish the save in flight, save this step for the persistent tier, wait until it is
        durable (within the deadline), and exit: 0 when it is durable, or committed in memory
        where no persistent tier is configured; 1 when it failed or missed the deadline."""
        logger.warning(
            "%s: preemption signal received (%s); saving step %d and exiting",
            self.namespace,
            self._watcher.describe(),
            step,
        )
        try:
            self.wait()
        except SaveFailedError:
            logger.exception("%s: the save before the preemption failed", self.namespace)
        code = 0
        deadline = time.monotonic() + self.preempt_deadline_s  # the save's and its upload's
        unreplicated = False
        try:
            if self.last_saved_step != step:
                # Losing this step would hurt: where the daemon replicates and has no persistent
                # tier, the save counts once every share has its replicas, not before.
                wait = "replicated" if replicates(self.config) else "committed"
                self._start(
                    step,
                    state,
                    persist=True,
                    wait=wait,
                    replicated_timeout_s=min(self.preempt_deadline_s, MAX_REPLICA_WAIT_S),
                )
            try:
                self.wait()
            except SaveFailedError as e:
                missing = not_replicated(e)
                if missing is None:
                    raise
                # Committed: it may still become durable, which is what the deadline is for.
                logger.warning("%s: %s", self.namespace, missing)
                unreplicated = True
            outcome = wait_durable(
                self.namespace,
                step,
                self.config,
                max(0.0, deadline - time.monotonic()),
                self._flag_group,
            )
            if outcome is Outcome.FAILED or (outcome is Outcome.MEMORY_ONLY and unreplicated):
                code = 1
            elif outcome is Outcome.MEMORY_ONLY and self._first_rank():
                # The save that could be made is made; say once for the job where it is.
                logger.warning(memory_only_warning(self.namespace, step))
        except Exception:
            logger.exception("%s: the save at preemption (step %d) failed", self.namespace, step)
            code = 1
        self._closed = True
        self._watcher.uninstall()
        # The loop's own destroy_process_group() is never reached; without it gloo's worker
        # threads outlive the interpreter and can abort the exit (SIGABRT instead of ``code``).
        # At exit, not here: ``finally`` blocks that unwind first may still use the groups.
        _destroy_at_exit()
        sys.exit(code)

    def _first_rank(self) -> bool:
        return self._flag_group is None or dist.get_rank(self._flag_group) == 0


_AT_EXIT = False
_AT_EXIT_LOCK = threading.Lock()


def _destroy_at_exit() -> None:
    """Have :func:`_destroy_process_groups` run when the interpreter exits (registered once).
    Registered when this module makes its first groups, not only at a preemption: a loop that
    ends normally (its ``destroy_process_group()`` does not stop the groups' threads either)
    exits past the last save's DCP collectives on the checkpoint group just the same."""
    global _AT_EXIT
    with _AT_EXIT_LOCK:
        if not _AT_EXIT:
            atexit.register(_destroy_process_groups)
            _AT_EXIT = True


def _destroy_process_groups() -> None:
    """Destroy the process groups, then drop this module's own checkpoint and flag groups, so that
    their gloo worker threads are joined here, while the interpreter still runs, not during its
    finalization. ``destroy_process_group`` does not stop a group's threads (the last reference
    to the group does), and a gloo thread that lets go of a Python object during finalization (a
    tensor of the save's last collective, on a loaded machine) ends inside C++: the process
    aborts with SIGABRT ("terminate called without an active exception") instead of exiting
    with its code. Checkpointers still referenced (one kept in a script's global) let go of
    their groups too. The agreements' tensors in ``_KEPT`` stay: they are freed by the main
    thread at finalization."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    with _GROUPS_LOCK:
        _GROUPS.clear()
    for ckpt in list(_LIVE):
        ckpt.process_group = ckpt._flag_group = None
    gc.collect()


def _fallback_step(e: CheckpointException) -> int | None:
    """The older step a load of "latest" could not switch to in its plan (the reader's
    ``fallback_step``), if that is why it failed."""
    steps = {getattr(exc, "fallback_step", None) for exc, _ in e.failures.values()}
    steps.discard(None)
    return steps.pop() if len(steps) == 1 else None
