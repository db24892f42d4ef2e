"""Loading a checkpoint runs no code from its files: every `torch.load` reads with `weights_only=True`, also
where a library asks for a full unpickle (DeepSpeed's checkpoint engine, accelerate's custom states), and the
classes DeepSpeed's checkpoints pickle are imported from the installed deepspeed and registered as torch safe
globals for the load alone, so a deepspeed that moved one is named, not silently refused as "code"."""

from __future__ import annotations

import builtins
import os
import pickle
from pathlib import Path

import pytest
import torch

from rlm.errors import UserError
from rlm.training import checkpointing


class Planted:
    """A pickle that, when loaded, creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


class Counter:
    """A custom object accelerate checkpoints (`custom_checkpoint_0.pkl`, which it loads with weights_only=False)."""

    def __init__(self):
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": torch.tensor(self.count)}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])


def test_every_torch_load_in_the_block_is_weights_only_even_when_the_caller_asks_for_a_full_unpickle(
    tmp_path, monkeypatch
):
    marker = tmp_path / "marker"
    torch.save({"state": Planted(marker)}, tmp_path / "planted.pt")
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    registered = set(torch.serialization.get_safe_globals())
    with (
        checkpointing.weights_only_loads([]),
        pytest.raises(pickle.UnpicklingError, match="Unsupported global"),
    ):
        torch.load(tmp_path / "planted.pt", weights_only=False)  # as DeepSpeed's checkpoint engine calls it
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # the block's setting only
    assert set(torch.serialization.get_safe_globals()) == registered


def test_load_checkpoint_restores_a_state_and_refuses_a_planted_custom_state_naming_file_and_class(
    tmp_path, fresh_accelerator_state
):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(
        torch.nn.Linear(3, 2), torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    )
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    counter.count = 7
    folder = tmp_path / "step_0000007"
    accelerator.save_state(str(folder))
    counter.count = 0
    checkpointing.check_pickles(folder)
    checkpointing.load_checkpoint(accelerator, folder)  # the RNG states' numpy arrays are safe globals
    assert counter.count == 7

    marker = tmp_path / "marker"
    torch.save({"state": Planted(marker)}, folder / "custom_checkpoint_0.pkl")
    with pytest.raises(UserError, match=r"custom_checkpoint_0\.pkl: io\.open"):
        checkpointing.load_checkpoint(accelerator, folder)
    assert not marker.exists()  # plain `accelerator.load_state(folder)` creates it


def deepspeed_checkpoint(folder: Path) -> Path:
    """A ZeRO optimizer-state file holding the classes DeepSpeed pickles there, in DeepSpeed's layout."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    path = folder / "pytorch_model" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.parent.mkdir(parents=True)
    state = {"loss_scaler": LossScaler(2.0), "zero_stage": ZeroStageEnum.gradients}
    state["param_slice_mappings"] = [{"weight": fragment_address(numel=4, start=0)}]
    torch.save({"optimizer_state_dict": state}, path)
    return path


def test_a_deepspeed_checkpoint_loads_weights_only_through_deepspeeds_own_engine(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.zero.config import ZeroStageEnum

    folder = tmp_path / "step_0000002"
    path = deepspeed_checkpoint(folder)
    checkpointing.check_pickles(folder)
    with checkpointing.weights_only_loads(checkpointing.checkpoint_safe_globals(folder)):
        state = TorchCheckpointEngine().load(str(path))  # it passes weights_only=False
    assert state["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.gradients
    assert state["optimizer_state_dict"]["loss_scaler"].cur_scale == 2.0


def test_a_deepspeed_without_a_class_its_checkpoints_pickle_is_named_at_load(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.zero.config

    folder = tmp_path / "step_0000002"
    deepspeed_checkpoint(folder)
    monkeypatch.delattr(deepspeed.runtime.zero.config, "ZeroStageEnum")  # as a release that renames it
    with pytest.raises(
        UserError, match=r"deepspeed\.runtime\.zero\.config\.ZeroStageEnum, which the installed"
    ):
        checkpointing.check_pickles(folder)
