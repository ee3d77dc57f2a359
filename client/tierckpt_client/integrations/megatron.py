"""Megatron-Core's ``dist_checkpointing`` with tierckpt steps in place of checkpoint folders.

Megatron-Core 0.19 (``megatron.core.dist_checkpointing``) saves a *sharded state dict* (each rank's
``ShardedTensor``/``ShardedObject`` views of the global tensors) through a save strategy into a
folder. Here the folder is a tierckpt step::

    from tierckpt_client.integrations import megatron as tc

    req = tc.save(model.sharded_state_dict(), "tierckpt://my-job/100", async_=True)
    ...                                   # training goes on; the state was staged before return
    req.result()                          # or poll req.done(): True once step 100 is committed
    state = tc.load(model.sharded_state_dict(), "tierckpt://my-job")   # the newest committed step
    model.load_state_dict(state)

What is Megatron's own code, and what is ours:

* Megatron's: ``save_preprocess``/``load_preprocess`` (factories, non-persistent objects, the
  common-state consistency check), ``validate_integrity_and_strict_load`` (each shard saved and
  loaded exactly once as a main replica, ``strict``), the common (non-tensor) state stored as the
  ``common_state`` ``ShardedObject`` inside the step, the translation to torch's sharded tensors
  and ``MCoreSavePlanner``/``MCoreLoadPlanner`` (so TP/PP/DP resharding on load is Megatron's),
  and ``FullyParallelSaveStrategyWrapper``/``FullyParallelLoadStrategyWrapper``
  (``fully_parallel=True``).
* Ours: the DCP storage layer (:class:`~tierckpt_client.dcp.TieredStorageWriter`/
  :class:`~tierckpt_client.dcp.TieredStorageReader`), the strategies that hand it to DCP, and the
  async path: ``dcp.async_save`` in THREAD mode on a gloo group of its own, staged straight into the
  node's memory tier before :func:`save` returns. Megatron's ``AsyncCallsQueue`` is not used: it
  counts a request done when a worker process ends and all-reduces on a CUDA device; the returned
  :class:`TieredSaveRequest` is done exactly when the step is committed on every node.
* No files: nothing is written to or read from a folder (no ``metadata.json``, no ``common.pt``).
  "latest" (``tierckpt://ns`` with no step) is the newest step the daemons committed, decided on
  rank 0 and broadcast.

Not used: Megatron's cached save plans (``cached_metadata``; every save plans afresh) and its
integrity manifest (tierckpt verifies every byte against its checksum on each read).
"""

from __future__ import annotations

import io
import logging
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    StateDict,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from tierckpt_client.checkpointer import SaveFailedError, checkpoint_groups
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp.ids import format_checkpoint_id, parse_checkpoint_id

__all__ = [
    "TieredLoadShardedStrategy",
    "TieredSaveRequest",
    "TieredSaveShardedStrategy",
    "load",
    "save",
]

logger = logging.getLogger(__name__)

COMMON_STATE = "common_state"  # Megatron's key for the non-tensor state inside the checkpoint


def _step_id(checkpoint_id: Any, what: str) -> tuple[str, int]:
    namespace, step = parse_checkpoint_id(str(checkpoint_id))
    if step is None:
        raise ValueError(
            f"{what} needs a step: tierckpt://{namespace}/<step>, got {checkpoint_id!r}"
        )
    return namespace, step


class TieredSaveRequest:
    """A save in flight: :meth:`done` is True once the step is committed on every node.

    Returned by :func:`save` with ``async_=True`` (and by the strategy's ``async_save``). Call
    :meth:`result` (or poll :meth:`done`) before the next save. Not thread-safe.
    """

    def __init__(self, namespace: str, step: int, future: Future[Any]):
        self.namespace = namespace
        self.step = step
        self.checkpoint_id = format_checkpoint_id(namespace, step)
        self._future = future

    def __repr__(self) -> str:
        return f"TieredSaveRequest({self.checkpoint_id!r}, done={self.done()})"

    def done(self) -> bool:
        """True once the save finished (committed, or failed: :meth:`result` raises). Local: no
        collective, no wait."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the commit (at most ``timeout`` seconds: ``TimeoutError`` after); raises
        :class:`~tierckpt_client.checkpointer.SaveFailedError` if the save failed."""
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise SaveFailedError.of(f"{self.checkpoint_id}: the save", e) from e

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(self)`` once the save finished (committed or failed), in the thread that
        finished it, or now if it has."""
        self._future.add_done_callback(lambda _: fn(self))

    def to_async_request(self) -> AsyncRequest:
        """This save as Megatron's ``AsyncRequest`` (no ``async_fn``; its one finalize function
        waits for the commit), for code that calls ``execute_sync()`` on one. With Megatron's
        ``AsyncCallsQueue`` that wait runs in the training thread at the next poll, and the queue
        all-reduces on a CUDA device: prefer :meth:`done`."""
        return AsyncRequest(None, (), [self.result])


class TieredSaveShardedStrategy(mcore_torch.TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy writing into a tierckpt step.

    ``checkpoint_dir`` is a checkpoint id ``tierckpt://<namespace>/<step>``. A subclass of
    ``TorchDistSaveShardedStrategy``, so ``dist_checkpointing``'s wrappers accept it; use it
    through :func:`save` (``dist_checkpointing.save`` would also write ``metadata.json`` into a
    folder of that name).

    Args:
        persist: save the step for the persistent tier (True), keep it in memory only (False), or
            the daemon's policy (None).
        process_group: the group for DCP's collectives; default: a gloo group of its own over
            every rank (an async save runs them in a background thread, beside training's own).
        keep_only_main_replica: as Megatron's (each shard is written once, by its main replica).
    """

    def __init__(
        self,
        *,
        persist: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        keep_only_main_replica: bool = True,
    ):
        super().__init__("torch_dist", 1, keep_only_main_replica=keep_only_main_replica)
        self.persist = persist
        self.process_group = process_group

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> None:
        self._write(sharded_state_dict, checkpoint_dir, async_=False).result()

    def async_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Any,
        async_strategy: str = "tierckpt",
    ) -> TieredSaveRequest:
        return self._write(sharded_state_dict, checkpoint_dir, async_=True)

    def _write(
        self, sharded_state_dict: ShardedStateDict, checkpoint_id: Any, *, async_: bool
    ) -> TieredSaveRequest:
        namespace, step = _step_id(checkpoint_id, "a Megatron save")
        # Megatron's own translation, as TorchDistSaveShardedStrategy.async_save does it.
        sd, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(sd, False)
        planner = mcore_torch.MCoreSavePlanner(
            dedup_replicated_tensors=not self.keep_only_main_replica,
            flatten_state_dict=False,
            flatten_sharded_tensors=False,
        )
        writer = TieredStorageWriter(namespace, step, persist=self.persist)
        group = self.process_group or checkpoint_groups(None)[0]
        future: Future[Any]
        if async_:
            ret = dcp.async_save(
                pyt_state_dict,
                storage_writer=writer,
                planner=planner,
                process_group=group,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            )
            # torch returns a response pairing staging and upload when staging is itself async.
            future = ret.upload_completion if isinstance(ret, AsyncSaveResponse) else ret
        else:
            future = Future()
            try:
                dcp.save(
                    pyt_state_dict, storage_writer=writer, planner=planner, process_group=group
                )
                future.set_result(None)
            except (Exception, CheckpointException) as e:
                future.set_exception(e)
        return TieredSaveRequest(namespace, step, future)


class TieredLoadShardedStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """Megatron's ``torch_dist`` load strategy reading a tierckpt step.

    ``checkpoint_dir`` is ``tierckpt://<namespace>/<step>`` (a step, not "latest": each rank loads
    on its own, as Megatron's strategy does, so :func:`load` resolves "latest" once before).
    """

    def load(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Any,
        async_strategy: str = "mcore",
    ) -> StateDict:
        namespace, step = _step_id(checkpoint_dir, "a Megatron load")
        # TorchDistLoadShardedStrategy.load, with our reader in place of its FileSystemReader.
        validated = [t for t in _sharded_tensors(sharded_state_dict) if not t.allow_shape_mismatch]
        mismatch = {
            t.key: t for t in _sharded_tensors(sharded_state_dict) if t.allow_shape_mismatch
        }
        orig = sharded_state_dict
        sd, flat_mapping, rename_mapping = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(sd, True)
        # megatron-core 0.19's per-tensor dequantization on load; 0.16 has no such option.
        streaming = (
            {"stream_ckpt_dequant": self.stream_ckpt_dequant}
            if hasattr(self, "stream_ckpt_dequant")
            else {}
        )
        dcp.load(
            pyt_state_dict,
            storage_reader=TieredStorageReader(namespace, step),
            planner=mcore_torch.MCoreLoadPlanner(
                shapes_validation_sharded_tensors=validated,
                allow_shape_mismatch_sharded_tensors=mismatch,
                flatten_state_dict=False,
                flatten_sharded_tensors=False,
                **streaming,
            ),
            no_dist=True,
        )
        out = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        out = mcore_torch._replace_sharded_keys_with_state_dict_keys(
            out, flat_mapping, rename_mapping
        )
        mcore_torch._restore_dict_types(out, orig)
        return out

    def _metadata(self, checkpoint_dir: Any) -> Metadata:
        namespace, step = _step_id(checkpoint_dir, "Megatron's checkpoint metadata")
        return TieredStorageReader(namespace, step).read_metadata()

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Metadata | None = None) -> Any:
        return super().load_tensors_metadata(
            checkpoint_dir, metadata or self._metadata(checkpoint_dir)
        )

    def load_sharded_metadata(self, checkpoint_dir: Any) -> ShardedStateDict:
        metadata = self._metadata(checkpoint_dir)
        out: dict[str, Any] = {}
        for key, entry in metadata.state_dict_metadata.items():
            if not hasattr(entry, "chunks"):  # bytes: a ShardedObject
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out


def _sharded_tensors(sharded_state_dict: ShardedStateDict) -> list[Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_id: str,
    *,
    async_: bool = False,
    fully_parallel: bool = False,
    parallelization_group: dist.ProcessGroup | None = None,
    persist: bool | None = None,
    validate_access_integrity: bool = True,
    content_metadata: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    preprocess_common: Any = None,
) -> TieredSaveRequest | None:
    """Save a Megatron sharded state dict as step ``checkpoint_id`` (``tierckpt://ns/<step>``);
    called by every rank, as ``dist_checkpointing.save``.

    Args:
        async_: return once the state is staged into the node's memory tier, with a
            :class:`TieredSaveRequest` whose ``done()`` turns True at the commit; else return
            ``None`` after the commit.
        fully_parallel: Megatron's ``FullyParallelSaveStrategyWrapper``: shards replicated across
            ``parallelization_group`` (default: every rank; the data-parallel group in training)
            are written by one of its ranks each, spread evenly.
        persist: as :class:`TieredSaveShardedStrategy`.
        validate_access_integrity: Megatron's check that each shard is written exactly once and
            that the common state agrees across ranks.
        content_metadata: stored as Megatron's ``content_metadata`` (see
            ``dist_checkpointing.load_content_metadata``).
        process_group: as :class:`TieredSaveShardedStrategy`.
        preprocess_common: Megatron's ``preprocess_common_before_consistancy_check`` (what of the
            common state the cross-rank check ignores).
    """
    _step_id(checkpoint_id, "a Megatron save")  # a bad id fails before any collective
    strategy: Any = TieredSaveShardedStrategy(persist=persist, process_group=process_group)
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy, parallelization_group)
    if content_metadata is not None:
        sharded_state_dict["content_metadata"] = content_metadata
    sharded_sd, common = save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common
    )
    # As dist_checkpointing.save: the common state is one object, written by rank 0 (replica 0).
    sharded_sd[COMMON_STATE] = ShardedObject(
        key=COMMON_STATE, data=common, global_shape=(1,), global_offset=(0,), replica_id=_rank()
    )
    if async_:
        req: TieredSaveRequest = strategy.async_save(sharded_sd, checkpoint_id)
        return req
    strategy.save(sharded_sd, checkpoint_id)
    return None


def _load_common(namespace: str, step: int) -> StateDict:
    key = ShardedObject(COMMON_STATE, None, (1,), (0,)).unique_key
    buf: dict[str, Any] = {key: io.BytesIO()}
    dcp.load(buf, storage_reader=TieredStorageReader(namespace, step), no_dist=True)
    loaded = buf[key]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=True)  # Megatron's own format, as it reads it
    common: StateDict = loaded[0]
    return common


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_id: str,
    *,
    fully_parallel: bool = False,
    parallelization_group: dist.ProcessGroup | None = None,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    validate_access_integrity: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> Any:
    """Load into Megatron's sharded state dict from ``checkpoint_id``: ``tierckpt://ns/<step>``,
    or ``tierckpt://ns`` for the newest committed step; called by every rank, as
    ``dist_checkpointing.load``, and returns what it returns (the state dict, or with a
    ``strict`` that asks for them, ``(state dict, missing keys, unexpected keys)``).

    The sharding may differ from the save's (other TP/PP/DP sizes): Megatron's load planner
    reads each rank's slices of the global tensors. ``fully_parallel``: Megatron's
    ``FullyParallelLoadStrategyWrapper`` (each replicated shard read by one rank of
    ``parallelization_group`` and exchanged). The step actually read is logged at INFO.
    """
    namespace, wanted = parse_checkpoint_id(str(checkpoint_id))
    group = process_group or checkpoint_groups(None)[0]
    probe = TieredStorageReader(namespace, wanted, process_group=group)
    probe.read_metadata()  # "latest" decided on rank 0 and broadcast: ranks never disagree
    step = probe.resolved_step
    assert step is not None
    ckpt_id = format_checkpoint_id(namespace, step)
    strategy: Any = TieredLoadShardedStrategy()
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(strategy, parallelization_group)

    # dist_checkpointing.load's steps, with the common state read from the step.
    sharded_sd, nonpersistent, factories = load_preprocess(sharded_state_dict)
    common = _load_common(namespace, step)
    merge(common, nonpersistent)
    sharded_sd, _ = extract_sharded_base(sharded_sd)
    strict = parse_strict_flag(strict)
    ckpt_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata = {
            k: v
            for k, v in strategy.load_sharded_metadata(ckpt_id).items()
            if v.key != COMMON_STATE
        }
    local_md = global_md = None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_md, global_md = determine_global_metadata(sharded_sd)
    sharded_sd, missing, unexpected = validate_integrity_and_strict_load(
        sharded_sd, strict, validate_access_integrity, local_md, global_md, ckpt_metadata
    )
    loaded = strategy.load(sharded_sd, ckpt_id)
    merge(common, loaded)
    apply_factory_merges(common, factories)
    logger.info("%s: loaded step %d", namespace, step)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common, missing, unexpected
    return common
