"""``python -m pretrain.data.prepare``: a corpus tokenized into megatron's indexed format."""
