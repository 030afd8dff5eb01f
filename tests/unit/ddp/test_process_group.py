"""framework/ddp/process_group.py in one process: what can be checked without a group."""

import warnings

import torch.distributed  # noqa: F401  (its deprecated reduce_op object is among the live objects)

from framework.ddp import process_group


def test_releasing_ddp_holders_looks_at_every_object_without_a_warning():
    """The scan at teardown reads each live object's type only: reading ``__class__`` of torch's
    deprecated ``reduce_op`` printed a FutureWarning at the end of every run."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert process_group.release_ddp_holders(object()) == 0
