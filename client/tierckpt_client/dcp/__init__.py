"""PyTorch DCP integration: ``TieredStorageWriter`` / ``TieredStorageReader``.

Example::

    import torch.distributed.checkpoint as dcp
    from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

    fut = dcp.async_save(state_dict, storage_writer=TieredStorageWriter("my-job", step=100))
    ...
    dcp.load(state_dict, storage_reader=TieredStorageReader("my-job"))  # newest committed step
"""

from tierckpt_client.dcp.reader import TieredStorageReader
from tierckpt_client.dcp.writer import SaveStats, TieredStorageWriter

__all__ = ["SaveStats", "TieredStorageReader", "TieredStorageWriter"]
