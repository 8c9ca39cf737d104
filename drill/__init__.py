"""The fault drill: an application on top of the launchers that kills, corrupts and restarts
real training runs, then judges the evidence against the source document's acceptance list."""
