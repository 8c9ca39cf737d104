"""Restoring a step: which step and tier (``plan``), whether the layout may change
(``topology``), what the resumed run keeps (``resume_policy``, ``resume_lr``)."""
