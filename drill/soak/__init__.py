"""``python -m drill.soak``: the chaos soak (faults at random times, ``plan``) and its judgement
against a clean run (``report``)."""
