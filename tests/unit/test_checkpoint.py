import os
import pickle

import pytest
import torch

from mixtrain import load_weights
from mixtrain.checkpoint import atomic_save


def test_atomic_save_round_trip_leaves_no_temp_files(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    path = atomic_save(state, tmp_path / "model.pt")
    assert torch.equal(load_weights(path)["w"], state["w"])
    assert os.listdir(tmp_path) == ["model.pt"]


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_load_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"w": _Payload()}, f)
    with pytest.raises(pickle.UnpicklingError):
        load_weights(path)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")
