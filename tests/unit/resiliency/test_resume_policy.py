"""The resume policy classifies every config key and judges each difference by its class."""

from __future__ import annotations

import dataclasses

import pytest

from recipes import ConfigError, RunConfig, load_config
from resiliency.checkpoint.restore.resume_policy import classify_key, flatten, reconcile

# The keys a resume refuses to change. A new config key lands here until someone classifies it
# in resume_policy.RULES: this list makes that a decision, not an accident.
MUST_MATCH = {
    "data.eod_mask_loss", "data.kind", "data.paths", "data.reset_attention_mask",
    "data.reset_position_ids", "data.seed", "data.split", "data.tokenizer", "data.tokenizer_path",
    "data.vocab_size", "data.weights", "model.activation", "model.add_bias_linear",
    "model.attention_dropout", "model.ffn_hidden_size", "model.hidden_dropout", "model.hidden_size",
    "model.max_position_embeddings", "model.moe_aux_loss_coeff", "model.moe_ffn_hidden_size",
    "model.moe_router_topk", "model.name", "model.normalization", "model.num_attention_heads",
    "model.num_experts", "model.num_layers", "model.num_query_groups",
    "model.position_embedding_type", "model.rotary_base", "model.seq_length",
    "model.share_embeddings_and_output_weights", "optimizer.name", "perf.fp8", "perf.fp8_recipe",
    "train.precision", "train.seed",
}  # fmt: skip


def _run(*overrides: str) -> RunConfig:
    return load_config(["recipe=gpt_tiny", "run_id=r", *overrides])


def _saved(*overrides: str) -> dict:
    return dataclasses.asdict(_run(*overrides))


def test_every_key_has_a_deliberate_class() -> None:
    keys = flatten(dataclasses.asdict(_run()))
    assert {k for k in keys if classify_key(k) == "must_match"} == MUST_MATCH
    assert classify_key("parallel.tp") == "topology"
    assert classify_key("optimizer.lr") == classify_key("scheduler.warmup_steps") == "schedule"
    assert classify_key("logging.log_interval") == classify_key("launch.nodes") == "free"


def test_identical_configs_change_nothing() -> None:
    decision = reconcile(_run(), _saved(), step=10)
    assert decision.applied == [] and decision.kept == []


def test_model_and_data_changes_are_refused_with_both_values() -> None:
    with pytest.raises(ConfigError) as err:
        reconcile(_run("model.hidden_dropout=0.1", "train.seed=7"), _saved(), step=10)
    assert "model.hidden_dropout: 0.0 -> 0.1" in str(err.value)
    assert "train.seed: 1234 -> 7" in str(err.value)


def test_train_steps_may_only_grow_past_the_restored_step() -> None:
    saved = _saved("scheduler.decay_steps=30")
    grown = reconcile(_run("train.train_steps=40", "scheduler.decay_steps=30"), saved, step=30)
    assert [c.key for c in grown.applied] == ["train.train_steps"]
    with pytest.raises(ConfigError, match="must exceed the restored step 30"):
        reconcile(_run("train.train_steps=20", "scheduler.decay_steps=30"), saved, step=30)


def test_a_schedule_change_needs_a_side() -> None:
    now = ("optimizer.lr=1e-3",)
    with pytest.raises(ConfigError, match="schedule_on_resume=checkpoint keeps the saved values"):
        reconcile(_run(*now), _saved(), step=10)
    kept = reconcile(_run(*now, "checkpoint.schedule_on_resume=checkpoint"), _saved(), step=10)
    assert kept.run.optimizer.lr == 3e-3 and [c.key for c in kept.kept] == ["optimizer.lr"]
    applied = reconcile(_run(*now, "checkpoint.schedule_on_resume=config"), _saved(), step=10)
    assert applied.run.optimizer.lr == 1e-3
    assert "optimizer.lr" in {c.key for c in applied.applied} and applied.kept == []


def test_an_implicit_decay_horizon_is_a_schedule_change() -> None:
    with pytest.raises(ConfigError, match="(?s)scheduler.decay_steps: 30 -> 40.*unset"):
        reconcile(_run("train.train_steps=40"), _saved(), step=30)
    kept = reconcile(
        _run("train.train_steps=40", "checkpoint.schedule_on_resume=checkpoint"), _saved(), 30
    )
    assert kept.run.scheduler.decay_steps == 30 and kept.run.train.train_steps == 40


@pytest.mark.parametrize("decay_now", ["30", "50"])
def test_keeping_an_implicit_horizon_pins_the_saved_one_whatever_this_launch_set(
    decay_now: str,
) -> None:
    """The saved schedule decayed over the saved train_steps (30). Kept, it stays 30 when this
    launch pins the same horizon (no change at all) or another one (kept), never the new
    train_steps (40) an unset value would follow."""
    now = _run(
        "train.train_steps=40",
        f"scheduler.decay_steps={decay_now}",
        "optimizer.lr=1e-3",
        "checkpoint.schedule_on_resume=checkpoint",
    )
    kept = reconcile(now, _saved(), step=30)
    assert kept.run.scheduler.decay_steps == 30 and kept.run.optimizer.lr == 3e-3
    assert ("scheduler.decay_steps" in {c.key for c in kept.kept}) == (decay_now != "30")


def test_growing_train_steps_with_the_saved_horizon_pinned_is_no_schedule_change() -> None:
    """The saved run left decay_steps unset (it followed train_steps=30); pinning it to 30
    while growing train_steps is free, with no schedule_on_resume asked."""
    grown = reconcile(_run("train.train_steps=40", "scheduler.decay_steps=30"), _saved(), 30)
    assert [c.key for c in grown.applied] == ["train.train_steps"] and grown.kept == []
    assert grown.run.scheduler.decay_steps == 30
