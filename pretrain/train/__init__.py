"""The training loop: the Trainer, the hook API it calls, the numeric guard's policy, evaluation,
progress and reporting, and the test-only fault injector."""
