"""What Trainer.fit returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Result:
    run_dir: Path
    """Folder with config.json, metrics.jsonl and model.safetensors (the final weights); hf_model/ too for a Hugging
    Face model."""
    model_path: Path
    """The final weights as a .safetensors file: mixtrain.load_weights(path), or safetensors itself."""
    state_dict: dict[str, torch.Tensor]
    """The final weights, on CPU."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One record per round: loss, samples/s, shares, per-worker compute/wait/comm seconds."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """Held-out metrics after each epoch (empty without eval data)."""
    workers: list[dict[str, Any]] = field(default_factory=list)
    """Where each worker ran: rank, host, pid, device, threads."""
    seconds_to_first_step: float = 0.0
    """From fit() being called to the first round being sent."""
    best_checkpoint: Path | None = None
    """The checkpoint with the best held-out metric (RunConfig.keep_best), kept beside the newest ones."""
    stopped_early: str | None = None
    """Why a callback (EarlyStopping, or one raising StopTraining) ended the run before its last step."""
    hf_model_path: Path | None = None
    """When the model is a Hugging Face transformers.PreTrainedModel: RUN_DIR/hf_model, the final weights as
    save_pretrained writes them (AutoModel.from_pretrained(path) loads it); None for any other model."""

    @property
    def path(self) -> str:
        """run_dir as text: the loop door's Result.path (both doors' Results have run_dir, path, metrics, workers)."""
        return str(self.run_dir)

    @property
    def metrics(self) -> dict[str, Any]:
        """The last held-out metrics, or the last training loss when there is no eval data."""
        if self.evals:
            return self.evals[-1]
        return {"loss": self.history[-1]["last_loss"]} if self.history else {}
