"""``python -m pretrain.hf``: moved to ``python -m resiliency.hf export|import`` (checkpoints
are read and published by the resiliency package, a layer above)."""

if __name__ == "__main__":
    from pretrain.moved import say_moved

    say_moved("pretrain.hf", "resiliency.hf")
