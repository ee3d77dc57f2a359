"""tierckpt_client.integrations.torchtitan: torchtitan's own checkpoint manager (our subclass),
its optimizer and LR-scheduler containers and an FSDP2 model on 2 gloo ranks on CPU, saving into
a real daemon; a fresh manager in fresh processes restores the model, optimizer, scheduler and
train state bit for bit; and the one flag (``--override.imports``) through torchtitan's own
config parser."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.config import Configurable
from torchtitan.config.override import OverrideConfig

from tierckpt_client import DaemonClient
from tierckpt_client.config import ClientConfig

from helpers import DaemonProcess, run_ranks

WORLD = 2
STEPS = 8  # interval 2: steps 2, 4, 6, 8 saved; 8 is the last step


class TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def _parts(seed: int) -> tuple[nn.Module, Any, Any]:
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # "fused" (torchtitan's default) is CUDA only.
    optim_cfg = dataclasses.replace(default_adamw(lr=1e-2), implementation="foreach")
    optimizers = optim_cfg.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=STEPS
    )
    return model, optimizers, schedulers


def _manager(
    model: nn.Module,
    optimizers: Any,
    schedulers: Any,
    state: TrainState,
    dump: str,
    namespace: str = "titan",
) -> Any:
    from tierckpt_client.integrations.torchtitan import TieredCheckpointManager

    config = TieredCheckpointManager.Config(
        enable=True,
        namespace=namespace,
        interval=2,
        keep_latest_k=2,
        persist_every=3,  # step 6; step 8 goes to the persistent tier as the last step
        last_save_model_only=False,  # the last step keeps the optimizer: it is resumed from
    )
    return config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=dump,  # torchtitan's step folders would go here (checkpoint.folder)
    )


def _step(model: nn.Module, optimizers: Any, schedulers: Any, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    return loss.detach()


def _full(model: nn.Module, optimizers: Any, schedulers: Any, state: TrainState) -> dict[str, Any]:
    """Everything that must round-trip, as full (unsharded) tensors and plain values."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, optimizers.optimizers[0], options=opts),
        "lr": schedulers.state_dict(),
        "step": state.step,
    }


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _train_and_save(rank: int, world: int, socket: str, out: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    model, optimizers, schedulers = _parts(seed=0)
    state = TrainState()
    manager = _manager(model, optimizers, schedulers, state, str(Path(out) / "dump"))
    assert manager.load() is False  # an empty namespace, no folder: a fresh start
    for step in range(1, STEPS + 1):
        _step(model, optimizers, schedulers, step)
        state.step = step
        manager.save(step, last_step=step == STEPS)
    manager.close()
    expected = _full(model, optimizers, schedulers, state)
    # The step after the checkpoint, for the resumed run to match.
    expected["next_loss"] = _step(model, optimizers, schedulers, STEPS + 1)
    torch.save(expected, Path(out) / f"rank{rank}.pt")


def _restore(rank: int, world: int, socket: str, out: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    model, optimizers, schedulers = _parts(seed=1)  # other weights: the load must replace them
    state = TrainState()
    manager = _manager(model, optimizers, schedulers, state, str(Path(out) / "dump"))
    assert manager.load() is True
    manager.close()
    got = _full(model, optimizers, schedulers, state)
    got["next_loss"] = _step(model, optimizers, schedulers, STEPS + 1)
    expected = torch.load(Path(out) / f"rank{rank}.pt", weights_only=False)
    _assert_equal(expected, got, f"rank{rank}")


@pytest.mark.slow
def test_manager_round_trips_fsdp2_model_optimizer_and_schedulers(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    store = tmp_path / "store"
    node = make_node(persist_url=f"file://{store}", keep_last=10)
    run_ranks(_train_and_save, WORLD, str(node.socket), str(tmp_path))
    with DaemonClient(ClientConfig.from_env(socket=node.socket)) as client:
        deadline = time.monotonic() + 60
        while True:  # step 6 (persist_every) and 8 (the last step) go to the tier
            states = {s.step: s.state.value for s in client.steps("titan")}
            if states.get(6) == states.get(8) == "durable" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    # keep_latest_k=2 deleted step 2 from the daemon at step 6's save (torchtitan does not
    # purge after the last step); nothing went to a step folder.
    assert states == {4: "committed", 6: "durable", 8: "durable"}, states
    assert sorted(p.name for p in (store / "titan").iterdir()) == [
        "step_000000000006",
        "step_000000000008",
    ]
    assert not (tmp_path / "dump").exists()
    run_ranks(_restore, WORLD, str(node.socket), str(tmp_path))


@dataclasses.dataclass(kw_only=True, slots=True)
class RunConfig(Configurable.Config):
    """The parts of ``Trainer.Config`` that the flag touches, typed as there. torchtitan's own
    registries (and its ``Trainer``) import triton, which has no use on CPU."""

    hf_assets_path: str = "."
    checkpoint: BaseCheckpointManager.Config = dataclasses.field(
        default_factory=CheckpointManager.Config
    )
    override: OverrideConfig = dataclasses.field(default_factory=OverrideConfig)


def _migrate(rank: int, world: int, socket: str, out: str) -> None:
    """A step folder written by torchtitan's own manager, then a tiered manager on the same
    folder and an empty namespace: it loads that folder's newest step."""
    os.environ["TIERCKPT_SOCKET"] = socket
    dump = str(Path(out) / "dump")
    model, optimizers, schedulers = _parts(seed=0)
    state = TrainState()
    plain = CheckpointManager.Config(enable=True, interval=2, keep_latest_k=0).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=dump,
    )
    for step in (1, 2):
        _step(model, optimizers, schedulers, step)
        state.step = step
        plain.save(step)
    plain.close()
    expected = _full(model, optimizers, schedulers, state)

    model, optimizers, schedulers = _parts(seed=1)
    state = TrainState()
    manager = _manager(model, optimizers, schedulers, state, dump, namespace="migrated")
    assert manager.load() is True
    manager.close()
    _assert_equal(expected, _full(model, optimizers, schedulers, state), f"rank{rank}")


@pytest.mark.slow
def test_an_empty_namespace_resumes_from_torchtitans_own_step_folder(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    node = make_node()
    run_ranks(_migrate, WORLD, str(node.socket), str(tmp_path))
    assert (tmp_path / "dump" / "checkpoint" / "step-2" / ".metadata").is_file()


def tiny_run() -> RunConfig:
    """A config_registry function: ``--module <this module> --config tiny_run``."""
    return RunConfig(checkpoint=CheckpointManager.Config(interval=50, last_save_model_only=False))


def test_one_flag_turns_a_torchtitan_config_into_a_tiered_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a torchtitan user adds on the command line, parsed by torchtitan's ConfigManager and
    applied by apply_overrides, as torchtitan.train and Trainer.__init__ do."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    from tierckpt_client.integrations.torchtitan import TieredCheckpointManager

    # ConfigManager imports torchtitan.experiments, whose RL package sets this variable in
    # os.environ (with a warning, torch being imported already); set here, it is undone after.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    kwargs = {"namespace": "my-job", "persist_every": 100}
    config = ConfigManager().parse_args(
        [
            "--module",
            __name__,
            "--config",
            "tiny_run",
            "--checkpoint.keep_latest_k",
            "3",
            "--override.imports",
            f"tierckpt_client.integrations.torchtitan.tiered_checkpoint={json.dumps(kwargs)}",
        ]
    )
    assert apply_overrides(config.override, config)
    ckpt = config.checkpoint
    assert type(ckpt) is TieredCheckpointManager.Config
    assert type(ckpt)._owner is TieredCheckpointManager  # what config.checkpoint.build() makes
    assert (ckpt.namespace, ckpt.persist_every, ckpt.async_mode) == ("my-job", 100, "async")
    assert ckpt.enable is True
    # The run's own settings are kept.
    assert (ckpt.interval, ckpt.keep_latest_k, ckpt.last_save_model_only) == (50, 3, False)


def test_config_refuses_what_it_cannot_do() -> None:
    from tierckpt_client.integrations.torchtitan import TieredCheckpointManager

    cfg = TieredCheckpointManager.Config
    with pytest.raises(ValueError, match="namespace is required"):
        cfg(enable=True)
    with pytest.raises(Exception, match="namespace"):
        cfg(namespace="../x")
    with pytest.raises(ValueError, match="persist_every"):
        cfg(namespace="job", persist_every=0)
    with pytest.raises(ValueError, match="last_save_in_hf"):
        cfg(namespace="job", last_save_in_hf=True)
    with pytest.raises(ValueError, match="async_mode"):
        cfg(namespace="job", async_mode="sometimes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_example_killed_and_run_again_resumes_bit_exact(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """examples/torchtitan_manager.py as a user runs it: an uninterrupted 6-step run (the
    reference); a second run SIGKILLed after step 3 (every rank, mid-save perhaps), then run
    again: it resumes from a step the first run saved and prints the reference's losses."""
    from helpers import run_loop

    example = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_manager.py"
    node = make_node()
    ref = run_loop(
        example,
        ["--namespace", "ref", "--steps", "6"],
        node.client_env,
        log_dir=tmp_path / "ref",
    )
    assert ref.returncodes == [0, 0], ref
    assert ref.start == 0 and sorted(ref.losses) == list(range(1, 7)), ref
    args = ["--namespace", "job", "--steps", "6"]
    killed = run_loop(
        example,
        [*args, "--step-time", "0.5"],
        node.client_env,
        log_dir=tmp_path / "killed",
        stop_after=3,
    )
    resumed = run_loop(example, args, node.client_env, log_dir=tmp_path / "resumed")
    assert killed.returncodes[0] != 0 and max(killed.losses) < 6, "the run was not killed"
    assert resumed.returncodes == [0, 0], resumed
    assert resumed.start is not None and 1 <= resumed.start <= max(killed.losses), resumed
    assert resumed.losses == {s: ref.losses[s] for s in range(resumed.start + 1, 7)}, resumed
    for step, loss in killed.losses.items():
        assert loss == ref.losses[step], f"step {step}"
