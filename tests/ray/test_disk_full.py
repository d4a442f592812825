"""A full disk never ends a healthy run: a real tmpfs as the run folder, too small for what the run writes."""

import contextlib
import subprocess

import pytest

from mixtrain import RunConfig, ScalingConfig, Trainer
from mixtrain.checkpoint import CheckpointStore, WeightsNotSaved
from tests.conftest import run_records
from tests.models import data, medium_task
from tests.ray.test_exactness import GLOBAL_BATCH, SEED

pytestmark = pytest.mark.usefixtures("ray_session")


@contextlib.contextmanager
def tmpfs(path, size_kb):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)], check=False)
    if mounted.returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fit(run_dir):
    x, y = data("mlp", GLOBAL_BATCH * 12)
    return Trainer(
        medium_task,
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=2, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(
            run_dir=str(run_dir), seed=SEED, steps_per_round=2, progress=False, checkpoint_every_s=0, tensorboard=False
        ),
    ).fit(epochs=1)


def test_checkpoints_that_do_not_fit_make_room_and_training_goes_on(tmp_path):
    # 1.5 MB: two checkpoints of ~0.55 MB fit, a third does not; the older ones go and it is written.
    with tmpfs(tmp_path / "disk", 1500) as disk:
        result = fit(disk / "run")
        assert sum(r["num_steps"] for r in result.history) == 12
        saved = run_records(result.run_dir, "checkpoint")
        assert len(saved) >= 6 and not run_records(result.run_dir, "checkpoint_failed")
        store = CheckpointStore(result.run_dir)
        assert store.paths()[0].name == "step-000000012" and len(store.paths()) < 3
        for path in store.paths():
            store.verify(path)
        assert (result.run_dir / "model.safetensors").is_file()


def test_weights_that_cannot_be_written_name_the_last_good_checkpoint_and_keep_the_state(tmp_path):
    # 700 KB: the first checkpoint fits, later ones never do; training still ends, and the final weights
    # (which do not fit either) come back in the exception with where the last good checkpoint is.
    with tmpfs(tmp_path / "disk", 700) as disk:
        with pytest.raises(WeightsNotSaved) as err:
            fit(disk / "run")
        text = str(err.value)
        assert "could not write the final weights" in text and "step-000000002" in text, text
        assert "0.weight" in err.value.state_dict
        store = CheckpointStore(disk / "run")
        store.verify(store.paths()[0])
