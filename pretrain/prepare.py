"""``python -m pretrain.prepare``: moved to ``python -m pretrain.data.prepare``."""

if __name__ == "__main__":
    from pretrain.moved import say_moved

    say_moved("pretrain.prepare", "pretrain.data.prepare")
