"""Raw errors at the step that a restart cannot fix, re-raised with their diagnosis: the module,
the cause and the setting that fixes it on the first line, the raw error as the cause."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from framework import DDPTrainer
from framework.ddp.policy import DDPConfigurationError, diagnose
from framework.model.loss_without_grad import LossWithoutGradError
from framework.resilience.markers import FatalError
from tests.dist_helper import one_process_group

RAW_NO_GRAD = "element 0 of tensors does not require grad and does not have a grad_fn"


class CheckpointedFirst(nn.Module):
    """PyTorch's DDP-test shape: the first layer is a reentrant-checkpointed block fed the raw input."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=True)


class FrozenThenCheckpointed(nn.Module):
    """A frozen input layer feeding a block checkpointed through its bound forward."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.block = nn.Linear(4, 1)

    def forward(self, x):
        return checkpoint(self.block.forward, self.frozen(x), use_reentrant=True)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.spare = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def trainer(tmp_path, model, **config):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    config = {"data.batch_size": 8, "train.max_steps": 3, "data.num_workers": 0, "logging.tensorboard": False,
              "eval.interval": 0, "train.target_loss": 0.0, "logging.dir": str(tmp_path / "logs"),
              "checkpoint.dir": str(tmp_path / "ck"), **config}
    return DDPTrainer(config=config, model=model, train_dataset=data, loss_fn=nn.functional.mse_loss)


@pytest.fixture
def one_rank_group():
    one_process_group()
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("model, module", [(CheckpointedFirst, "'block' (Sequential)"),
                                           (FrozenThenCheckpointed, "'block' (Linear)")])
def test_reentrant_checkpoint_without_grad_inputs_is_named_at_the_step(tmp_path, model, module):
    with pytest.raises(FatalError) as caught:
        trainer(tmp_path, model()).train()
    err = caught.value
    first = str(err).splitlines()[0]
    assert isinstance(err, LossWithoutGradError), err
    assert f"{module} in the forward of the model ({model.__name__})" in first, first
    assert "checkpoint(use_reentrant=True) got no input that requires grad" in first, first
    assert "Fix: pass use_reentrant=False" in first and "inputs.requires_grad_(True)" in first, first
    assert "memory.activation_checkpointing=non_reentrant" in first, first
    assert RAW_NO_GRAD in str(err.__cause__)
    assert module in (tmp_path / "ck" / "FATAL").read_text()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_without_grad_inputs_is_named_by_the_ddp_preflight(tmp_path, one_rank_group):
    with pytest.raises(LossWithoutGradError, match=r"'block' \(Sequential\) in the forward of the model") as caught:
        trainer(tmp_path, CheckpointedFirst())
    assert RAW_NO_GRAD in str(caught.value.__cause__)


def test_ddp_unused_parameter_error_names_the_module_and_the_setting(tmp_path, one_rank_group):
    """find_unused_parameters forced off with an unused layer: DDP's raw 'finished reduction' error
    in the second step's forward, which names the parameters only by index."""
    run = trainer(tmp_path, WithUnused(), **{"ddp.find_unused_parameters": "false"})
    with pytest.raises(FatalError) as caught:
        run.train()
    err = caught.value
    first = str(err).splitlines()[0]
    assert isinstance(err, DDPConfigurationError), err
    assert "in module 'spare' (Linear) (parameters spare.weight, spare.bias)" in first, first
    assert "got no gradient" in first and "Fix: set ddp.find_unused_parameters=true" in first, first
    assert "Expected to have finished reduction" in str(err.__cause__)


@pytest.mark.parametrize("message, names, fix", [
    ("Expected to mark a variable ready only once. This error ...\nParameter at index 1 with name block.bias has "
     "been marked as ready twice.", "module 'block' (Linear) (parameters block.bias)", "ddp.static_graph=auto"),
    ("Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
     "that your training graph has changed in this iteration, e.g., ...\nParameter indices which did not receive "
     "grad for rank 0: 2 3", "module 'spare' (Linear)", "ddp.static_graph=false"),
])
def test_ddp_errors_name_the_module_from_the_raw_message(message, names, fix):
    model = WithUnused()
    model.block = nn.Linear(1, 1)
    err = diagnose(RuntimeError(message), model)
    first = str(err).splitlines()[0]
    assert names in first and f"Fix: set {fix}" in first, first
