"""Hugging Face transformers interop: export a published step as a transformers directory
(``export``), check it against the run's own validation loss, and import one as a step-0
checkpoint to continue pretraining from (``import``). ``python -m resiliency.hf`` runs this."""
