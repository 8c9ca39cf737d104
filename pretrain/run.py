"""``python -m pretrain.run``: moved to ``python -m launch.torchrun`` (a launcher wrapper lives
with the launchers)."""

if __name__ == "__main__":
    from pretrain.moved import say_moved

    say_moved("pretrain.run", "launch.torchrun")
