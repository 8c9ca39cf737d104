"""Does an exported directory compute what the run computed? transformers' loss on the run's own
validation batches (the same samples, seq length and loss mask) against the validation loss the
run logged at that step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pretrain.context.run_dir import RunDir, iter_jsonl
from pretrain.data import dataset as data
from pretrain.data.dataset import split_sizes
from resiliency.hf.export import VerifiedStep, step_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossCheck:
    hf_loss: float
    run_loss: float | None  # None: the run did not validate at this step

    @property
    def relative_gap(self) -> float | None:
        if self.run_loss is None:
            return None
        return abs(self.hf_loss - self.run_loss) / abs(self.run_loss)


def validation_batches(step: VerifiedStep) -> list[list[dict[str, torch.Tensor]]]:
    """The run's validation global batches, each as its microbatches (the run's grouping, so
    a per-microbatch masked mean is the same mean)."""
    run = step.run
    mbs, gbs = run.train.micro_batch_size, run.train.global_batch_size
    plan = data.BatchPlan(mbs, gbs // mbs, 1, 0)
    cache = RunDir(step.step_dir.parent.parent).data_cache_dir
    _, valid, _ = data.build_datasets(
        run.data, step_tokenizer(step), run.model.seq_length, split_sizes(run, plan), cache
    )
    if valid is None:
        raise ValueError("the run has no validation split (train.eval_interval is 0)")
    return [data.microbatches(valid, plan, i * gbs) for i in range(run.train.eval_iters)]


def hf_validation_loss(model_dir: Path, step: VerifiedStep) -> LossCheck:
    # transformers: an optional extra (hf), needed only here
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load: noise next to the result line

    if step.run.data.reset_position_ids or step.run.data.reset_attention_mask:
        raise ValueError(
            "the run reset positions/attention at document ends; transformers' "
            "causal LM does not, so its loss is not comparable"
        )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    totals = []
    with torch.no_grad():
        for batch in validation_batches(step):
            losses = [_masked_loss(model, micro) for micro in batch]
            totals.append(sum(losses) / len(losses))
    hf_loss = float(sum(totals) / len(totals))
    return LossCheck(hf_loss, logged_validation_loss(step))


def _masked_loss(model: torch.nn.Module, micro: dict[str, torch.Tensor]) -> float:
    logits = model(input_ids=micro["tokens"]).logits.float()
    per_token = F.cross_entropy(
        logits.view(-1, logits.shape[-1]), micro["labels"].view(-1), reduction="none"
    )
    mask = micro["loss_mask"].view(-1).float()
    return float((per_token * mask).sum() / mask.sum().clamp(min=1.0))


def logged_validation_loss(step: VerifiedStep) -> float | None:
    """The run's own validation loss at the step (metrics/eval.jsonl), if it validated there."""
    found = None
    for record in iter_jsonl(RunDir(step.step_dir.parent.parent).eval_metrics):
        if record.get("split") == "valid" and record.get("step") == step.manifest.step:
            found = float(record["loss"])  # the last one: a resumed run may validate again
    return found
