"""What it is trained on: the datasets and sample cursor, tokenizers, and ``prepare/`` (the
corpus-tokenizing command ``python -m pretrain.data.prepare``)."""
