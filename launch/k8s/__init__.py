"""Kubernetes: the Kubeflow PyTorchJob rendered from a run (``cli``: render, submit, status, logs,
delete), its pod (``pod``), validation against the shipped CRD (``schema``), the API calls
(``api``) and the entry point each pod runs (``entry``)."""
