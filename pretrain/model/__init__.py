"""What is trained: the GPT/MoE model chunks, the optimizer and its schedule, the FLOP count."""
